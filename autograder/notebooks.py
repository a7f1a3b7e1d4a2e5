"""Keep the instructor's notebooks in a stable, reviewable form: no outputs, no run counts.

    python autograder/notebooks.py solutions/*/*.ipynb          # normalise in place
    python autograder/notebooks.py --check solutions/*/*.ipynb  # exit 1 if any would change
"""

import argparse
import sys

import nbformat

VOLATILE_CELL_KEYS = ("collapsed", "scrolled", "execution", "trusted", "jupyter")


def normalized(path):
    """The notebook's canonical text: what `nbformat.write` gives once outputs are gone."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for key in VOLATILE_CELL_KEYS:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info")}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    stale = []
    for path in args.paths:
        text = normalized(path)
        with open(path) as f:
            if f.read() == text:
                continue
        stale.append(path)
        if not args.check:
            with open(path, "w") as f:
                f.write(text)
    if args.check and stale:
        print("not normalised (run `make format`):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
