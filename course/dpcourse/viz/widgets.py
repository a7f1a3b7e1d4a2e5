"""One way to put controls on a picture: every explorer of the course is made by `explorer`.

Used by the explorers of notebooks 01 (`shard_explorer`), 02 (`phase_explorer`), 03
(`collective_explorer`), 04 (`ring_explorer`) and 05 (`timeline_explorer`).

Why one helper: a learner meets the same thing each time -- the controls in a row above the
picture, the picture redrawn whenever a control moves, a play button where there are steps to walk
through -- and a widget is a few lines of what is particular to it (its controls and how to draw),
not a copy of the ipywidgets wiring.
"""


def explorer(controls, draw, play=None, interval=1500):
    """Show `controls` ({name: ipywidget}) in a row above an output that `draw(**values)` fills.

    `draw` is called with every control's value whenever one changes (it draws with matplotlib
    and calls plt.show()). `play`: the name of an integer slider to add a play button for, which
    steps it every `interval` ms. Displays the widget and returns it.
    """
    import ipywidgets as widgets
    from IPython.display import display

    row = list(controls.values())
    if play is not None:
        slider = controls[play]
        button = widgets.Play(value=slider.value, min=slider.min, max=slider.max, interval=interval)
        widgets.jslink((button, "value"), (slider, "value"))
        row.insert(0, button)
    out = widgets.interactive_output(draw, controls)
    box = widgets.VBox([widgets.HBox(row), out])
    display(box)
    return box
