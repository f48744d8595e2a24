"""`kvadmit bench vllm`'s chart (no engine runs): one horizontal bar a config, a colour
per family, and the three reference rows (vLLM's default, its best watermark by the
scorecard's rule, kvadmit's default) hatched and named in the legend."""
import matplotlib

matplotlib.use("Agg")

from kvadmit.bench.vllm import output as bench  # noqa: E402  (the table, JSON and chart)


def row(config, steps, preemptions):
    return {"config": config, "steps": steps, "preemptions": preemptions,
            "output_tok_per_s": 1000.0 * 1300 / steps, "modelled_tok_per_s": 900.0 * 1300 / steps}


ROWS = [row("vllm-default", 1300, 51), row("vllm-watermark=0.01", 1310, 40),
        row("vllm-watermark=0.05", 1500, 3), row("vllm-watermark=0.1", 1700, 3),
        row("adaptive", 1472, 5), row("kvadmit-default", 1400, 1)]


def test_the_reference_rows_are_marked():
    assert bench.plot_marks(ROWS) == {"vllm-default": "vLLM's default",
                                      "vllm-watermark=0.05": "vLLM's best knob",   # 3, then fewer steps
                                      "kvadmit-default": "kvadmit's default"}
    assert bench.plot_marks(ROWS[4:]) == {"kvadmit-default": "kvadmit's default"}


def test_the_chart_draws_level_labels_and_family_colours(tmp_path):
    from matplotlib.colors import to_hex
    fig = bench.plot(ROWS, str(tmp_path / "x.png"), "title")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [r["config"] for r in ROWS]
    assert all(t.get_rotation() == 0 for t in ax.get_yticklabels())
    bold = [t.get_text() for t in ax.get_yticklabels() if t.get_fontweight() == "bold"]
    assert bold == ["vllm-default", "vllm-watermark=0.05", "kvadmit-default"]
    bars = ax.patches
    colours = [to_hex(b.get_facecolor()) for b in bars]
    assert colours == [bench.PLOT_COLOURS["vLLM"]] * 4 + [bench.PLOT_COLOURS["kvadmit"]] * 2
    assert [b.get_hatch() for b in bars] == ["//", None, "xx", None, None, ".."]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["vLLM's scheduler and its knobs", "kvadmit's policies",
                      "vLLM's default: vllm-default", "vLLM's best knob: vllm-watermark=0.05",
                      "kvadmit's default: kvadmit-default"]
