"""``classgrad plot``: the PNGs are valid images of the expected pixel size (read back with
PIL), the heatmap uses the stored similarity when there is one and computes it for the top-N
classes otherwise, projected stores get no parameter chart, and the clustered order puts
planted groups of classes next to each other."""

from __future__ import annotations

import numpy as np
import pytest

from classgrad.service.analysis.inspect import inspect_store
from classgrad.service.analysis.plot import (
    average_linkage,
    average_linkage_order,
    class_similarity,
    dendrogram_segments,
    plot_store,
)
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.png import check_png
from tests.support.stores import dense_similarity, synthetic_store


def test_pngs_with_computed_similarity(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=120)
    result = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=25, dpi=50)
    assert set(result["files"]) == {"similarity_heatmap", "class_norms", "param_norms"}
    # Fixed figure sizes in inches times the dpi (no tight bounding box).
    assert result["sizes"] == {"similarity_heatmap": [450, 400], "class_norms": [400, 250], "param_norms": [450, 300]}
    for name, path in result["files"].items():
        check_png(path, tuple(result["sizes"][name]))
    assert result["similarity_source"] == "computed" and result["metric"] == "cosine"
    norms = np.linalg.norm(rows.astype(np.float64), axis=1)
    assert sorted(result["heatmap_rows"]) == sorted(np.argsort(-norms)[:25].tolist())


def test_heatmap_uses_the_stored_similarity(tmp_path):
    synthetic_store(tmp_path / "s", num_classes=120)
    compute_similarity(str(tmp_path / "s"), executor="local", metric="dot")
    result = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=10)
    assert result["similarity_source"] == "stored" and result["metric"] == "dot"
    check_png(result["files"]["similarity_heatmap"], (900, 800))


def test_projected_store_and_cli(tmp_path, capsys):
    synthetic_store(tmp_path / "p", num_classes=40, projected=True, dim=24)
    assert cli_main(["plot", str(tmp_path / "p"), "--out", str(tmp_path / "png"), "--top-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "similarity_heatmap.png (900 x 800)" in out and "class_norms.png (800 x 500)" in out
    assert "no per-parameter norms" in out and not (tmp_path / "png" / "param_norms.png").exists()
    check_png(str(tmp_path / "png" / "class_norms.png"), (800, 500))


def test_computed_similarity_matches_numpy(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=50)
    ids = np.array([3, 7, 11, 40])
    sim, metric, source = class_similarity(store, ids, "cosine", block_mb=4 * 30 * 4 / 2**20)
    ref = dense_similarity(rows[ids], "cosine")
    # Products in float64 over 4 bands; one rounding to float32 at the end.
    assert source == "computed" and np.abs(sim - ref).max() <= 2.0**-23


def test_average_linkage_order_groups_planted_clusters():
    rng = np.random.default_rng(3)
    centers = rng.standard_normal((4, 30))
    labels = rng.permutation(np.repeat(np.arange(4), 8))
    x = centers[labels] + 0.2 * rng.standard_normal((32, 30))
    cos = dense_similarity(x.astype(np.float32), "cosine")
    order = average_linkage_order(1.0 - cos)
    assert sorted(order.tolist()) == list(range(32))
    runs = 1 + int((np.diff(labels[order]) != 0).sum())
    assert runs == 4  # every cluster is one contiguous run
    assert np.array_equal(order, average_linkage_order(1.0 - cos))  # deterministic
    assert average_linkage_order(np.zeros((2, 2))).tolist() == [0, 1]


def test_bad_options(tmp_path):
    from classgrad.errors import ConfigError

    synthetic_store(tmp_path / "s", num_classes=20)
    with pytest.raises(ConfigError, match=r"top_n \(--top-n\)"):
        plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=1)


def test_a_failed_plot_leaves_no_output_directory(tmp_path, capsys):
    """`classgrad plot missing.zarr --out p2` once failed but created p2/."""
    assert cli_main(["plot", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "p2")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "p2").exists()


def many_params_store(path, num_params: int, num_classes: int = 60):
    """A store with ``num_params`` parameters of very different sizes (1 .. 64 elements)."""
    from classgrad.store import ParamSlot

    slots, offset = [], 0
    for i in range(num_params):
        size = 1 + (i * 37) % 64
        slots.append(ParamSlot(f"blocks.{i}.proj.weight", (size,), offset, size))
        offset += size
    names = tuple(f"class-{i}" for i in range(num_classes))
    store, rows = synthetic_store(path, num_classes=num_classes, dim=offset, layout=tuple(slots), class_names=names)
    return store, rows, slots


def test_param_chart_shows_per_element_norms_capped_with_a_count(tmp_path):
    store, rows, slots = many_params_store(tmp_path / "s", num_params=70)
    result = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=10, dpi=40)
    drawn = result["param_norms"]
    x = rows.astype(np.float64)
    rms = {e.name: np.sqrt(np.square(x[:, e.offset : e.offset + e.size]).sum() / e.size) for e in slots}
    expected = sorted(rms, key=lambda name: -rms[name])[:25]
    assert drawn["names"] == expected and drawn["more"] == 70 - 25
    # grad_norms squares in float32 (each square off by <= 2^-24 relative), sums in float64;
    # the square root halves that: 1e-7 relative is ample and far below any ranking difference.
    np.testing.assert_allclose(drawn["rms"], [rms[name] for name in expected], rtol=1e-7)
    assert drawn["rms"] == sorted(drawn["rms"], reverse=True)
    check_png(result["files"]["param_norms"], tuple(result["sizes"]["param_norms"]))


def test_param_chart_without_cap_has_no_more_note(tmp_path):
    synthetic_store(tmp_path / "s", num_classes=30)
    drawn = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=5, dpi=40)["param_norms"]
    assert sorted(drawn["names"]) == ["head.weight", "layer.bias", "layer.weight"] and drawn["more"] == 0


def test_heatmap_labels_and_dendrogram(tmp_path):
    many_params_store(tmp_path / "s", num_params=3)
    few = plot_store(str(tmp_path / "s"), str(tmp_path / "a"), top_n=12, dpi=40)
    # Heatmap, colorbar and the dendrogram above: three axes.
    drawn = {k: few["heatmap"][k] for k in ("tick_labels", "dendrogram", "axes")}
    assert drawn == {"tick_labels": 12, "dendrogram": True, "axes": 3}
    many = plot_store(str(tmp_path / "s"), str(tmp_path / "b"), top_n=50, dpi=40)
    assert many["heatmap"]["tick_labels"] == 0 and many["heatmap"]["dendrogram"]
    # Issue 29: margins fit the labels shown (none kept for labels not shown), so the heatmap takes
    # the room: it was a 5 in square in a 9 x 8 in figure whatever it showed.
    assert many["heatmap"]["side_in"] > few["heatmap"]["side_in"] > 5.5 and many["heatmap"]["side_in"] > 6.0


def test_heatmap_colour_scale_is_the_largest_off_diagonal_value(tmp_path):
    # Issue 29: cosines between classes drawn on a +-1 scale came out nearly white.
    many_params_store(tmp_path / "s", num_params=3)
    result = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=12, dpi=40)
    store = open_store(str(tmp_path / "s"))
    sim, _, _ = class_similarity(store, np.array(result["heatmap_rows"]), "cosine", block_mb=1.0)
    off = np.abs(sim[~np.eye(12, dtype=bool)])
    assert result["heatmap"]["vmax"] == pytest.approx(float(off.max()), rel=1e-6)  # same float32 products
    assert result["heatmap"]["vmax"] < 1.0


def test_param_chart_says_its_ranking_and_shows_inspects_share(tmp_path):
    # Issue 29: plot ranked by RMS per element, inspect by share of the squared norm, unsaid.
    many_params_store(tmp_path / "s", num_params=8)
    drawn = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=5, dpi=40)["param_norms"]
    shares = {p["name"]: p["share"] for p in inspect_store(open_store(str(tmp_path / "s")))["param_norms"]}
    assert drawn["ranking"] == "rms_per_element"
    # Both from the same float64 sums of float32 squares: equal to rounding.
    np.testing.assert_allclose(drawn["share"], [shares[name] for name in drawn["names"]], rtol=1e-12)


def test_heatmap_tick_text_is_legible():
    """Every tick label of the heatmap is at least 8 pt, whatever the number of classes."""
    from classgrad.service.analysis import plot

    assert plot.TICK_FONT >= 8 and plot.MAX_LABELS <= 40


def test_average_linkage_tree_matches_the_order():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 6))
    cos = dense_similarity(x.astype(np.float32), "cosine")
    order, merges = average_linkage(1.0 - cos)
    assert np.array_equal(order, average_linkage_order(1.0 - cos)) and merges.shape == (8, 3)
    assert np.all(np.diff(merges[:, 2]) >= -1e-12)  # UPGMA heights never decrease (float64 averages)
    lines = dendrogram_segments(order, merges)
    assert len(lines) == 8
    # The last merge joins everything: its bar spans the middle of the leaves.
    xs, ys = lines[-1]
    assert 0 <= min(xs) <= max(xs) <= 8 and ys[1] == ys[2] == merges[-1, 2]
