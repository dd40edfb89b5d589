"""`lora-parity locate --plot DIR`: the per-point plot is a PNG of the result, never written over a file without
--force nor through a link; the markdown links it."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from lora_parity.evidence.locate_models import LocateResult
from lora_parity.util.errors import ConfigError

from .conftest import cli
from .test_locate import RECEIPT, _one_line_exit_2, _result

pytestmark = pytest.mark.unit
pytest.importorskip("matplotlib")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_plot_is_a_png_of_every_point_with_the_named_point_marked(tmp_path: Path) -> None:
    from lora_parity.report import locate_plot

    result = LocateResult.model_validate(_result())
    assert result.divergences  # the engine leaves at layers.2: marked on the plot
    fig = locate_plot.figure(result)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0] == "embed" and labels[-1] == "norm" and len(labels) == len(result.points)
    assert any("engine leaves: layers.2" in t.get_text() for t in ax.texts)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("engine: threshold") for t in legend) and any("trainer: median" in t for t in legend)
    path = locate_plot.draw(result, tmp_path / "sub" / "r.locate.png")
    width, height = _png_size(path)
    assert (width, height) == (1100, 462) and path.stat().st_size > 10_000


def test_the_plot_is_never_written_through_a_link(tmp_path: Path) -> None:
    from lora_parity.report import locate_plot

    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "r.locate.png").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        locate_plot.draw(LocateResult.model_validate(_result()), tmp_path / "r.locate.png")
    assert victim.read_text() == "keep"


def test_an_existing_plot_is_refused_before_anything_runs(tmp_path: Path) -> None:
    receipt = tmp_path / "r.json"
    shutil.copy(RECEIPT, receipt)
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "r.locate.png").write_text("keep")
    _one_line_exit_2(cli("locate", str(receipt), "--plot", str(plots)), "r.locate.png", "exists", "--force")
    assert (plots / "r.locate.png").read_text() == "keep" and not (tmp_path / "r.locate.json").exists()


def test_the_markdown_links_the_plot() -> None:
    from lora_parity.report.locate import markdown

    text = markdown(LocateResult.model_validate(_result()), "r.json", "plots/my run (1).locate.png")
    assert "![distance from fp32 per point](plots/my%20run%20%281%29.locate.png)" in text
