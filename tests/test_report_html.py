"""``report.html`` as a person sees it: real tables, inline images, readable numbers, honest captions;
rendered in headless Chromium and the screenshot kept as a test artifact."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from analysis import report
from analysis.document import num, pct, readable

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "slurm_run"
ARTIFACTS = Path(os.environ.get("SLURMTRON_TEST_ARTIFACTS", REPO / "test-artifacts"))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert report.main([str(FIXTURE), "--out", str(out)]) == 0
    return out


def test_numbers_are_readable():
    assert num(0.00023530913676329097) == "0.000235" and num(339.240474340264) == "339" and num(12345.6) == "12,346"
    assert pct(0.17611) == "17.6%" and num(float("nan")) == "\u2014"


def test_html_has_real_tables_inline_images_and_no_raw_values(rendered):
    page = (rendered / "report.html").read_text()
    assert "<pre>" not in page and page.count("<table>") >= 3 and "<th>cause</th>" in page
    assert page.count("src='data:image/png;base64,") == 4  # mfu, loss by step, timeline, goodput
    assert "lm loss by step" in page or "lm loss against the step" in page
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    assert not re.search(r"\d\.\d{7,}", text), "unrounded numbers"
    assert "{'" not in text and "nan" not in re.sub(r"<[^>]+>", " ", text).split(), "a raw dict or nan"
    # the empty MFU says why: the fixture ran on cluster.gpu: cpu
    assert "cluster.gpu is cpu: no accelerator peak FLOP/s to compare against" in page
    assert "no config.yaml" not in page and "no model shape" not in page


def test_readable_tables_name_units():
    import pandas as pd

    df = readable(pd.DataFrame({"step_time_s": [1.23456], "tokens_per_s": [339.24], "mfu": [0.4123]}))
    assert list(df.columns) == ["step time (s)", "tokens/s", "MFU"] and df.iloc[0].tolist() == ["1.23", "339", "41.2%"]


def test_headless_chromium_screenshot(rendered):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    shot = rendered / "report.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,2400", f"--screenshot={shot}", (rendered / "report.html").as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert shot.exists(), proc.stderr[-2000:]
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1100
    rgb = img[..., :3]
    not_white = (rgb < 0.95).any(axis=-1)
    assert 0.03 < not_white.mean() < 0.6, "the page rendered blank (or all ink)"
    colored = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.3  # plot lines and bars are in colour
    assert colored.mean() > 0.002, "no figure is visible"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report.png")
    shutil.copy(rendered / "report.html", ARTIFACTS / "report.html")


def test_a_small_runs_rendering():
    """A one-minute run: a one-cell table's caption is not squeezed to the cell's width, the goodput legend is in
    a unit its numbers show in, and a step axis has whole-number ticks only."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from analysis.document import to_html
    from analysis.plots import _integer_ticks, time_unit

    page = to_html([("table", pd.DataFrame(), "one row per attempt that ended before the run finished")], "t")
    assert "<caption>" not in page
    assert re.search(r"<p class='cap'>one row per attempt that ended before the run finished</p><table>", page)
    assert time_unit(45.0) == ("s", 1.0) and time_unit(600.0) == ("min", 60.0) and time_unit(9000.0) == ("h", 3600.0)
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3, 4], [3.0, 2.5, 2.2, 2.0])
    _integer_ticks(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    plt.close(fig)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
