"""Refresh the README's pictures (docs/*.png) from the browser tests' latest screenshots.

    .venv/bin/python -m pytest tests/lab/browser tests/hub  # browser-screenshots/<test>/NN-<step>.png
    .venv/bin/python tests/lab/browser/docs_pictures.py     # six of them into docs/, trimmed and small
    .venv/bin/python tests/lab/browser/docs_pictures.py hub-feedback.png   # only the ones named

The committed pictures are for visitors of the repository only: no test compares against them, so a
change of JupyterLab's look never fails a test, and refreshing them is this one command.
"""

import sys
from pathlib import Path

from PIL import Image, ImageChops

REPO = Path(__file__).resolve().parents[3]
SHOTS = REPO / "browser-screenshots"
DOCS = REPO / "docs"

# docs/<picture>: (test, step) of the screenshot it comes from
PICTURES = {
    "notebook-widget.png": ("test_ring_replay_redraws_when_its_slider_moves", "notebook-widget"),
    "ring-replay.png": ("test_ring_replay_redraws_when_its_slider_moves", "ring-replay"),
    "formgrader.png": ("test_formgrader_lists_the_assignments_and_shows_the_scores", "formgrader"),
    "hub-assignments.png": ("test_a_class_on_jupyterhub_from_release_to_feedback", "assignments-tab"),
    "hub-feedback.png": ("test_a_class_on_jupyterhub_from_release_to_feedback", "feedback"),
    "class-report.png": ("test_a_class_on_jupyterhub_from_release_to_feedback", "class-report"),
}
MARGIN = 12  # pixels of background kept around the trimmed content
COLOURS = 64  # a palette this size keeps text and the course's pictures crisp at a fraction of the bytes


def trimmed(image):
    """The image without the background (its most frequent colour) along its edges."""
    _, colour = max(image.getcolors(image.width * image.height))
    background = Image.new(image.mode, image.size, colour)
    box = ImageChops.difference(image, background).getbbox()
    if box is None:
        return image
    left, top, right, bottom = box
    return image.crop((max(left - MARGIN, 0), max(top - MARGIN, 0),
                       min(right + MARGIN, image.width), min(bottom + MARGIN, image.height)))


def main(names=()):
    DOCS.mkdir(exist_ok=True)
    unknown = sorted(set(names) - set(PICTURES))
    if unknown:
        print(f"no such picture: {', '.join(unknown)} (known: {', '.join(PICTURES)})", file=sys.stderr)
        return 2
    for name, (test, step) in PICTURES.items():
        if names and name not in names:
            continue
        found = sorted((SHOTS / test).glob(f"[0-9][0-9]-{step}.png"))
        if not found:
            print(f"no screenshot {step!r} of {test} in {SHOTS}: run the browser tests first",
                  file=sys.stderr)
            return 1
        image = trimmed(Image.open(found[-1]).convert("RGB"))
        image = image.quantize(COLOURS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        image.save(DOCS / name, optimize=True)
        print(f"docs/{name}: {image.width}x{image.height}, {(DOCS / name).stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
