"""dpcourse.viz.curves: the shared minibatch loop calls the step with the right indices."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from dpcourse.viz.curves import plot_curves, train_curve, warmup_factor  # noqa: E402


def test_train_curve_covers_each_epoch_once_in_full_batches():
    seen = []
    curve = train_curve(lambda index, number: seen.append((index.clone(), number)), lambda: len(seen),
                        n=10, batch=3, epochs=2, progress=False)
    assert [s for s, _ in curve] == [0, 9, 18]
    assert [n for _, n in seen] == list(range(6))
    first_epoch = torch.cat([i for i, _ in seen[:3]])
    assert len(set(first_epoch.tolist())) == 9 and all(len(i) == 3 for i, _ in seen)


def test_train_curve_is_reproducible():
    runs = [[], []]
    for run in runs:
        train_curve(lambda index, _, r=run: r.append(index.tolist()), lambda: 0, 8, 4, 2, seed=5,
                    progress=False)
    assert runs[0] == runs[1]


def test_warmup_factor_ramps_linearly():
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_plot_curves_draws_one_line_per_curve():
    import matplotlib.pyplot as plt

    ax = plot_curves({"a": [(0, 1.0), (10, 0.5)], "b": [(0, 1.0), (10, 0.2)]}, log=True)
    assert len(ax.get_lines()) == 2
    plt.close("all")
