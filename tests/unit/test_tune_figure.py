"""tune's predicted-against-measured figure (fsdp_exp/tune/output.py ``figure``) on hand-made measurements: zoomed
to the measured points, logarithmic where they span more than a factor of 10, and neighbouring labels on
alternate sides of their points."""

from __future__ import annotations

from types import SimpleNamespace

from fsdp_exp.tune.output import figure
from fsdp_exp.tune.search import Weighed
from fsdp_exp.tune.space import Candidate


def _tuning(pairs: list[tuple[float, float]]):
    candidates = []
    for i, (predicted, measured) in enumerate(pairs):
        w = Weighed(Candidate(f"c{i:04d}", [], None), rank=i + 1)
        w.prediction = SimpleNamespace(tokens_per_s=predicted)
        w.measured = {"tokens_per_s": measured, "tokens_per_s_ci": [measured * 0.95, measured * 1.05]}
        candidates.append(w)
    return SimpleNamespace(candidates=candidates, device=SimpleNamespace(name="cpu_host"))


def _axes(fig):
    return fig.axes[0]


def test_measured_points_fill_the_plot_and_their_labels_alternate_sides():
    pairs = [(50_000, 48_000), (49_500, 48_500), (49_000, 47_800), (47_000, 46_000)]
    ax = _axes(figure(_tuning(pairs), {"spearman": 0.8}))
    low, high = ax.get_xlim()
    assert ax.get_xscale() == "linear" and low >= 0.9 * 46_000 and high <= 1.1 * 50_000  # no empty corner
    offsets = [a.xyann[1] for a in ax.texts]
    assert len(offsets) == 4 and all(a * b < 0 for a, b in zip(offsets, offsets[1:]))


def test_points_over_a_factor_of_ten_apart_are_drawn_on_log_axes():
    pairs = [(50_000, 48_000), (49_000, 47_000), (2_000, 1_500)]
    ax = _axes(figure(_tuning(pairs), {"spearman": 1.0}))
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
