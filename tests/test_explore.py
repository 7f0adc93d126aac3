"""`h2o-mini explore` in a real browser: Debian's Chromium driven headless by Selenium through Debian's
chromedriver (the two come from one source package, so their versions always match; Playwright would want
to download its own browser build, which this offline machine cannot). What the page shows is checked
against the cache itself, read through the Python API, not against the page's own data."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h2o_mini import api
from h2o_mini.cache import KVCache
from h2o_mini.policies import make_policy
from h2o_mini.views.record import record

from .conftest import GPL3

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# .ci/run installs both and sets this, so that CI fails rather than skips if they are missing
REQUIRED = os.environ.get("H2O_MINI_BROWSER_TESTS") == "required"
T, C = 120, 24


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        if REQUIRED:
            pytest.fail("chromium and chromedriver are needed (apt-get install chromium chromium-driver)")
        pytest.skip("browser tests need Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(byte_folder, tmp_path_factory):
    """A page of h2o and local at C = 24 over 120 tokens of the GPL, on the tiny LLaMA (2 layers, 2 KV heads)."""
    out = tmp_path_factory.mktemp("explore") / "page.html"
    folder = byte_folder("llama_gqa_tied")
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "explore", "--model", str(folder), "--text", str(GPL3),
                        "--tokens", str(T), "--policy", "h2o", "--policy", "local", "--budget", str(C), "--out",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out, api.load(folder)


def _open(browser, path: Path):
    browser.get(path.as_uri())
    browser.get_log("browser")  # start each test with an empty console


def _set(browser, **controls):
    """Set the page's controls as a user would (the value, then the event the page listens to)."""
    for name, value in controls.items():
        event = "input" if name == "step" else "change"
        browser.execute_script(f"const e = document.getElementById('{name}'); e.value = arguments[0];"
                               f"e.dispatchEvent(new Event('{event}'));", str(value))


def _kept(browser, panel: int) -> list[int]:
    return browser.execute_script(
        f"return [...document.querySelectorAll('#panel-{panel} .tok')].filter(s => !s.classList.contains('evicted')"
        " && !s.classList.contains('future')).map(s => Number(s.dataset.pos));")


def _cache_positions(lm, policy, ids, layer, head) -> list[int]:
    """The positions the real cache holds after reading `ids` (stream mode, chunks of 16), via the API."""
    cache = KVCache(lm.model.cfg, policy, 1, len(ids), prefill="stream")
    x = torch.tensor([ids])
    with torch.inference_mode():
        for s in range(0, len(ids), 16):
            lm.model(x[:, s:s + 16], torch.arange(s, min(s + 16, len(ids)))[None], cache)
    pos = cache.layers[layer].pos[0, head]
    return sorted(pos[pos >= 0].tolist())


def test_the_page_loads_from_file_with_no_console_errors(browser, page):
    _open(browser, page[0])
    assert browser.find_element("id", "panel-0").get_attribute("data-policy") == "h2o"
    assert browser.find_element("id", "panel-1").get_attribute("data-policy") == "local"
    assert len(browser.find_elements("css selector", "#panel-0 .tok")) == T
    _set(browser, step=50, layer=1, head="all")
    browser.find_element("id", "play").click()
    browser.find_element("id", "play").click()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    assert "http" not in page[0].read_text().split("<script")[0].lower().replace("http-equiv", "")  # nothing fetched


@pytest.mark.parametrize("t", [10, C - 1, 57, T - 1])
def test_local_keeps_exactly_the_c_newest(browser, page, t):
    _open(browser, page[0])
    _set(browser, step=t, layer=0, head=0)
    assert _kept(browser, 1) == list(range(max(0, t - C + 1), t + 1))


@pytest.mark.parametrize("layer,head", [(0, 0), (1, 1), (1, 0)])
def test_h2o_at_the_last_step_shows_the_cache_s_own_positions(browser, page, layer, head):
    out, lm = page
    _open(browser, out)
    _set(browser, step=T - 1, layer=layer, head=head)  # switching layer and head changes the view to that record
    ids = api.scored_ids(lm, GPL3.read_text(), T)
    want = _cache_positions(lm, make_policy("h2o", C, T), ids, layer, head)
    assert _kept(browser, 0) == want
    assert len(want) == C and want != list(range(T - C, T))  # heavy hitters, not only a window


def test_the_diff_marks_exactly_where_the_two_policies_differ(browser, page):
    out, lm = page
    _open(browser, out)
    _set(browser, step=90, layer=1, head=0)
    ids = api.scored_ids(lm, GPL3.read_text(), T)
    a = set(record(lm.model, ids[:91], make_policy("h2o", C, T), snapshots=1).kept(1, 0, 90))
    b = set(range(90 - C + 1, 91))  # local
    marked = browser.execute_script("return [...document.querySelectorAll('#panel-0 .tok.diff')].map(s => "
                                    "Number(s.dataset.pos));")
    assert set(marked) == a ^ b and marked
    tip = browser.execute_script("return tipFor(arguments[0]);", sorted(a ^ b)[0])
    assert "h2o" in tip and "local" in tip and "position" in tip


def test_explore_refuses_bad_input(byte_folder, tmp_path):
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "explore", "--model", str(byte_folder("llama_gqa_tied")),
                        "hi there", "--text", str(GPL3), "--out", str(tmp_path / "x.html")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "not both" in r.stderr and not (tmp_path / "x.html").exists()
    r = subprocess.run([sys.executable, "-m", "h2o_mini", "explore", "--out", str(tmp_path / "x.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown extension" in r.stderr


def test_the_recording_is_bounded_and_self_consistent(byte_folder):
    """The recorder that plot kept and explore share: kept sets hold min(t + 1, C) positions, and its matrix
    view agrees with its set view."""
    lm = api.load(byte_folder("llama_gqa_tied"))
    ids = api.scored_ids(lm, GPL3.read_text(), 60)
    rec = record(lm.model, ids, make_policy("tova", 12, 60), snapshots=5)
    assert rec.steps == [0, 15, 30, 44, 59] and len(rec.scores) == 5
    m = rec.kept_matrix(1, 1)
    for t in (0, 11, 12, 40, 59):
        assert rec.kept(1, 1, t) == m[:, t].nonzero().flatten().tolist() and len(rec.kept(1, 1, t)) == min(t + 1, 12)
    assert [s.shape for s in rec.scores[-1]] == [(2, 12), (2, 12)]
