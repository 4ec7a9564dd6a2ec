"""The notebooks in JupyterLab, in a real browser, as a student opens them; the widgets driven.

Starts JupyterLab headless on a free localhost port (empty token) over a *copy* of notebooks/ and
img/ (running them must not rewrite the committed notebooks) and drives Debian's chromium with
Playwright. nbval runs every cell of every notebook in a Jupyter kernel (``make nbval``, on two kernel
sets); what only a browser shows is that JupyterLab renders the notebooks and that the widgets answer.
So, for every notebook:

* it opens, its kernel starts, and its stored outputs render: every picture (plots, the img/ diagrams)
  decodes and no stored output is an error;
* its set-up cell runs without error, in that kernel;
* a notebook with a widget also runs the widget's cell and the cells that cell needs (found from the
  names it reads: see ``cells_needed``), and the widget is moved with the keyboard or the mouse until
  what it shows changes: notebook 05's ZeRO memory calculator, 06's rank slider, 11's period explorer
  and 12's bandwidth explorer;
* one notebook, ``FULL_RUN``, is run top to bottom, as a student first does.

Screenshots go to screenshots/ (git-ignored) for a reviewer to look at.

Skipped, with the reason shown by ``pytest -rs``, when chromium or Playwright is missing.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from course_lib.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
SHOTS = ROOT / "screenshots"
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - reported as a skip
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: `apt-get install chromium` to run the "
                                                "browser test (.ci/run does)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: make test installs it"),
]


_LAB_LOG = [None]


def _lab_log_tail(chars=3000):
    path = _LAB_LOG[0]
    return path.read_text(errors="replace")[-chars:] if path and path.exists() else ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    work = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", work / "notebooks", ignore=shutil.ignore_patterns("my_*.py", ".ipynb_*"))
    shutil.copytree(ROOT / "img", work / "img")
    # notebooks 09 and 10 read the committed contest tables, as they do in a clone
    shutil.copytree(ROOT / "benchmarks" / "results", work / "benchmarks" / "results")
    # JupyterLab 4 leaves off-screen cells out of the page unless windowing is off
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # offline: no news or update checks (and no pop-up asking about them over the screenshots)
    news = work / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                       "checkForUpdates": False}))
    port = free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(work / "settings"), JUPYTER_CONFIG_DIR=str(work / "config"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={work}",
           "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "lab.log", "w")
    _LAB_LOG[0] = work / "lab.log"  # the kernels' stderr: what a crashed worker printed before it died
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"JupyterLab did not start: {(work / 'lab.log').read_text()[-2000:]}") from None
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield b
        b.close()


# Ready: the notebook we opened (not a tab restored from an earlier page) is current, with an idle kernel
NOTEBOOK_READY = """(name) => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    if (!w || !w.sessionContext || !w.context || !w.context.isReady || !w.context.path.endsWith(name)) return false;
    const k = w.sessionContext.session && w.sessionContext.session.kernel;
    return !!k && k.status === 'idle';
}"""

# Stored outputs are cleared before the run, so every count, error and picture seen after it is this run's
CLEARED = """() => Array.from(window.jupyterapp.shell.currentWidget.content.model.cells)
    .every(c => c.type !== 'code' || (c.executionCount === null && c.outputs.length === 0))"""

ALL_RUN = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    const k = w.sessionContext.session.kernel;
    const cells = Array.from(w.content.model.cells).filter(c => c.type === 'code' && c.sharedModel.getSource().trim());
    if (k.status !== 'idle' || cells.length === 0) return false;
    // run-all stops at the first error: then the remaining cells never run, and we are done
    const failed = cells.some(c => c.outputs.toJSON().some(o => o.output_type === 'error'));
    return failed || cells.every(c => c.executionCount !== null);
}"""

# For a timeout's message: the first code cells that have not finished, with their last output
PENDING = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    const out = [];
    Array.from(w.content.model.cells).forEach((c, i) => {
        if (c.type !== 'code' || !c.sharedModel.getSource().trim() || c.executionCount !== null) return;
        const outs = c.outputs.toJSON().map(o => JSON.stringify(o.text || o.data || o.evalue || '').slice(-300));
        out.push(`cell ${i} (${c.sharedModel.getSource().split('\\n')[0]}): ${outs.join(' | ')}`);
    });
    return out.slice(0, 3);
}"""

KERNEL_IDLE = "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'"

# Every picture in the notebook (plots, the img/ diagrams): whether the browser decoded it
PICTURES = """() => Array.from(document.querySelectorAll('.jp-Notebook img'))
    .map(i => i.complete && i.naturalWidth > 0)"""

ERRORS = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    const out = [];
    Array.from(w.content.model.cells).forEach((c, i) => {
        if (c.type !== 'code') return;
        for (const o of c.outputs.toJSON()) {
            if (o.output_type === 'error') out.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
        }
    });
    return out;
}"""


# The notebook run top to bottom in the browser: the student's first, which starts workers, shows a
# progress bar, catches a failing worker and draws a figure.
FULL_RUN = "00_setup.ipynb"

# Notebooks with a widget: the call that makes it, and what moves it
WIDGETS = {
    "05_": ("memory_calculator(", lambda page: _move_memory_calculator(page)),
    "06_": ("rank_explorer(", lambda page: _move_rank_slider(page)),
    "11_": ("period_explorer(", lambda page: _move_period_slider(page)),
    "12_": ("bandwidth_explorer(", lambda page: _move_bandwidth_slider(page)),
}


def _names(source: str) -> tuple[set, set, set]:
    """The names a cell binds (assignments, imports, definitions, loop targets), changes (``x[k] = ...``,
    ``x.a = ...``, ``x += ...``: x must exist already) and reads (the changed ones included)."""
    tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    augmented = {id(node.target) for node in ast.walk(tree) if isinstance(node, ast.AugAssign)}
    bound, changed, read = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                read.add(node.id)
            elif id(node) in augmented:
                changed.add(node.id)
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                while isinstance(target, (ast.Subscript, ast.Attribute)):
                    target = target.value
                    if isinstance(target, ast.Name):
                        changed.add(target.id)
    return bound, changed, read | changed


def cells_needed(sources: list[str], target: int) -> list[int]:
    """The code cells to run, in order, for cell ``target`` to run: the first (the set-up), the target, and
    every cell before it that binds or changes a name the target, or a cell it needs, reads and has not
    bound itself. (A name a cell changes by calling a method, ``x.update(...)``, is seen as read only: a
    cell that fills a dictionary that way would be missed, and the run would then end in an error, which
    the test reports.)"""
    bound, _, read = _names(sources[target])
    need, chosen = read - bound, [target]
    for i in range(target - 1, -1, -1):
        bound, changed, read = _names(sources[i])
        if i == 0 or (bound | changed) & need:
            chosen.append(i)
            need = (need - bound) | (read - bound)
    return sorted(chosen)


def test_cells_needed_follows_the_names_back():
    sources = ["import torch", "a = 1", "b = 2", "c = a + 1\nfor r in range(c): pass", "d = {}\nd['k'] = 3",
               "print(c, d, r)"]
    assert cells_needed(sources, 5) == [0, 1, 3, 4, 5]  # b is not read; r is bound by cell 3, which is needed anyway
    assert cells_needed(sources, 2) == [0, 2]
    # a cell that changes d needs the cell that made it; so does one that adds to n
    assert cells_needed(["import torch", "d = {}", "d['k'] = 3", "print(d)"], 3) == [0, 1, 2, 3]
    assert cells_needed(["import torch", "n = 1", "n += 1", "m = 2", "print(n)"], 4) == [0, 1, 2, 4]


def _code_cells(name: str) -> tuple[list[int], list[str]]:
    """The index (among all cells, as JupyterLab numbers them) and the source of every code cell of a notebook."""
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    code = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    return [i for i, _ in code], [src for _, src in code]


# Run these cells (indices among all cells), one after another, as a student selecting each and pressing
# Shift-Enter would; returns at once (the run goes on in the page).
RUN_CELLS = """(indices) => {
    const app = window.jupyterapp, w = app.shell.currentWidget;
    (async () => {
        for (const i of indices) {
            w.content.activeCellIndex = i;
            await app.commands.execute('notebook:run-cell');
        }
    })();
}"""

# Those cells have all run (or one ended in an error), and the kernel is idle
CELLS_RUN = """(indices) => {
    const w = window.jupyterapp.shell.currentWidget;
    const cells = indices.map(i => w.content.model.cells.get(i));
    if (w.sessionContext.session.kernel.status !== 'idle') return false;
    const failed = cells.some(c => c.outputs.toJSON().some(o => o.output_type === 'error'));
    return failed || cells.every(c => c.executionCount !== null);
}"""


@pytest.fixture(scope="module")
def page(lab, browser):
    """One JupyterLab page for every notebook, as a student keeps one open: loading the app once, not once a
    notebook, saves its start-up each time. Each test opens its notebook in it and closes it at the end."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # a workspace of its own, reset: nothing an earlier run left open is restored
    page.goto(f"{lab}/lab/workspaces/course-test?reset", wait_until="domcontentloaded")
    page.wait_for_function("() => !!(window.jupyterapp && window.jupyterapp.shell)", timeout=120_000)
    page.evaluate("async () => { await window.jupyterapp.restored; }")
    yield page
    page.close()


def _open(page, name):
    page.evaluate("(path) => { window.jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'}); }",
                  f"notebooks/{name}")
    page.wait_for_function(NOTEBOOK_READY, arg=name, timeout=120_000)


# As a student closing the notebook: its kernel (and any workers) shut down, the tab closed without saving
CLOSE = """async () => {
    const w = window.jupyterapp.shell.currentWidget;
    if (w && w.sessionContext) await w.sessionContext.shutdown();
    if (w) w.dispose();
}"""


def _clear(page):
    # every count, error and picture seen after this is this run's
    page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    page.wait_for_function(CLEARED, timeout=30_000)


def _run_cells(page, name, indices, timeout_s=240):
    page.evaluate(RUN_CELLS, indices)
    try:
        page.wait_for_function(CELLS_RUN, arg=indices, timeout=timeout_s * 1000, polling=500)
    except PlaywrightTimeout:
        page.screenshot(path=str(SHOTS / f"{name}.timeout.png"), full_page=True)
        pytest.fail(f"{name}: cells {indices} did not finish in {timeout_s} s; not yet run or still running: "
                    f"{page.evaluate(PENDING)}")


def _run_all(page, name, timeout_s=240):
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    try:
        page.wait_for_function(ALL_RUN, timeout=timeout_s * 1000, polling=1000)
    except PlaywrightTimeout:
        page.screenshot(path=str(SHOTS / f"{name}.timeout.png"), full_page=True)
        pytest.fail(f"{name}: run-all did not finish in {timeout_s} s; cells not yet run or still running: "
                    f"{page.evaluate(PENDING)}")


def _check_pictures(page, name):
    # every notebook draws figures, and shows the img/ diagrams it names: all must be decoded images
    shown = page.evaluate(PICTURES)
    diagrams = (ROOT / "notebooks" / name).read_text().count("../img/")
    assert len(shown) > diagrams and all(shown), f"{name}: {len(shown)} pictures, decoded: {shown}"


def _check_no_errors(page, name, when):
    errors = page.evaluate(ERRORS)
    assert errors == [], f"{name}: {when}, cells ended in errors: {errors}\n\nJupyterLab's log ends:\n{_lab_log_tail()}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_renders_and_runs_in_jupyterlab(page, name):
    try:
        _open(page, name)
        # the stored outputs, as a student opening the notebook sees them
        _check_no_errors(page, name, "as stored")
        _check_pictures(page, name)
        page.screenshot(path=str(SHOTS / f"{name}.before.png"))
        _clear(page)
        positions, sources = _code_cells(name)
        widget = next((w for prefix, w in WIDGETS.items() if name.startswith(prefix)), None)
        if name == FULL_RUN:
            _run_all(page, name)
            ran = range(len(positions))
        else:
            ran = [0]
            if widget is not None:
                call = widget[0]
                target = next(i for i, src in enumerate(sources) if call in src and "import" not in src.split(call)[0])
                ran = cells_needed(sources, target)
            _run_cells(page, name, [positions[i] for i in ran])
        page.screenshot(path=str(SHOTS / f"{name}.after.png"))
        _check_no_errors(page, name, f"after running code cells {list(ran)}")
        if name == FULL_RUN:
            _check_pictures(page, name)  # this run's figures
        if widget is not None:
            widget[1](page)
    except BaseException:
        page.screenshot(path=str(SHOTS / f"{name}.failed.png"), full_page=True)
        raise
    finally:
        page.evaluate(CLOSE)


def _press(page, slider, key, times):
    """Keyboard on the slider's handle, as a student without a mouse would."""
    slider.locator(".noUi-handle").first.focus()
    for _ in range(times):
        page.keyboard.press(key)


def _wait_changed(page, locator, attribute, before):
    """Wait until the kernel has answered the widget: the element changed and the kernel is idle again."""
    page.wait_for_function(f"([el, before]) => el.{attribute} !== before", arg=[locator.element_handle(), before],
                           timeout=60_000)
    page.wait_for_function(KERNEL_IDLE, timeout=60_000, polling=250)


def _explorer(page, label, marker, shot, within=None):
    """An explorer widget's slider (by its label), its text (by a word in it) and its picture; only inside
    the first element matching the CSS selector ``within`` if given."""
    root = page if within is None else page.locator(within).first
    slider = root.locator(".widget-slider", has=page.locator("label", has_text=label)).first
    slider.scroll_into_view_if_needed()
    text = root.locator(".widget-html", has_text=marker).first
    picture = text.locator("xpath=following-sibling::img[1]")
    page.screenshot(path=str(SHOTS / f"{shot}.before.png"))
    return slider, text, picture


def _move_rank_slider(page):
    slider, text, picture = _explorer(page, "rank", "relative error", "06_rank_slider")
    before, src = text.inner_text(), picture.get_attribute("src")
    _press(page, slider, "ArrowRight", 3)
    # 4 (the stored state) + three steps to the right; the kernel recomputes and redraws
    page.wait_for_function("el => el.innerText.startsWith('rank 7:')", arg=text.element_handle(), timeout=60_000)
    _wait_changed(page, picture, "src", src)
    after, src = text.inner_text(), picture.get_attribute("src")
    page.screenshot(path=str(SHOTS / "06_rank_slider.after.png"))
    assert before.startswith("rank 4:") and "relative error" in after and after != before
    # the matrix menu: the photograph has other numbers, and another picture, at the same rank
    page.locator(".widget-dropdown select").first.select_option(label="grace_hopper.jpg in grey (600 x 512)")
    _wait_changed(page, text, "innerText", after)
    _wait_changed(page, picture, "src", src)
    page.screenshot(path=str(SHOTS / "06_matrix_menu.after.png"))
    assert text.inner_text().startswith("rank 7:")


def _move_bandwidth_slider(page):
    slider, text, picture = _explorer(page, "GB/s", "bus bandwidth", "12_bandwidth_slider")
    before, src = text.inner_text(), picture.get_attribute("src")
    _press(page, slider, "ArrowRight", 4)  # up the log scale, 0.05 a step
    _wait_changed(page, text, "innerText", before)
    _wait_changed(page, picture, "src", src)
    page.screenshot(path=str(SHOTS / "12_bandwidth_slider.after.png"))
    gbps = [float(re.search(r"bus bandwidth ([\d.]+) GB/s", t).group(1)) for t in (before, text.inner_text())]
    assert gbps[0] == 1.25 and gbps[1] > 1.25, gbps


def _total_bytes(text: str) -> int:
    """The total row of the memory calculator's table (its bytes column), as shown."""
    return int(re.search(r"total\s+([\d,]+)", text).group(1).replace(",", ""))


def _move_memory_calculator(page):
    """Notebook 05's ZeRO memory calculator: click stage 3, then add ranks with the keyboard; each rank
    must be shown holding less each time, in the numbers and in the picture."""
    slider, text, picture = _explorer(page, "world size", "bytes per rank", "05_memory_calculator")
    stage = page.locator(".widget-toggle-buttons", has=page.locator("label", has_text="ZeRO stage")).first

    def click_stage(label):
        before, src = text.inner_text(), picture.get_attribute("src")
        stage.get_by_role("button", name=label, exact=True).click()
        _wait_changed(page, text, "innerText", before)
        _wait_changed(page, picture, "src", src)
        return before

    if stage.locator("button.mod-active").inner_text().strip() == "3":  # stored at stage 3: start from DDP
        click_stage("0 (DDP)")
    before = click_stage("3")
    after = text.inner_text()
    assert re.search(r"bytes per rank: stage 3,", after), after[:200]
    assert _total_bytes(after) < _total_bytes(before), (before, after)
    # more ranks (fewer at the top of the slider): under stage 3 each rank's share of every model state shrinks
    fewer = re.search(r"; (\d+) ranks;", after).group(1) == "1024"
    src = picture.get_attribute("src")
    _press(page, slider, "ArrowLeft" if fewer else "ArrowRight", 2)
    _wait_changed(page, text, "innerText", after)
    _wait_changed(page, picture, "src", src)
    page.screenshot(path=str(SHOTS / "05_memory_calculator.after.png"))
    moved = text.inner_text()
    assert (_total_bytes(moved) > _total_bytes(after)) if fewer else (_total_bytes(moved) < _total_bytes(after)), \
        (after, moved)


def _period_numbers(text: str) -> tuple[int, float, float, float]:
    """The period explorer's H, bus bandwidth (GB/s), local SGD's step time and its all-reduce's time (ms), as shown."""
    found = re.search(r"communicate every (\d+) steps?: local SGD ([\d,.]+) ms a step \(one all-reduce of [\d.]+ MB, "
                      r"([\d,.]+) ms.*?bus bandwidth ([\d.]+) GB/s", text, re.S)
    assert found, text[:300]
    return (int(found.group(1)), float(found.group(4)), float(found.group(2).replace(",", "")),
            float(found.group(3).replace(",", "")))


def _move_period_slider(page):
    """Notebook 11's period explorer: a faster link, then a longer period H, with the keyboard (the other
    way where a slider is at its end). A faster link shortens the all-reduce, and local SGD's step with it;
    a longer period shares the all-reduce among more steps: local SGD's step shortens."""
    bandwidth, text, picture = _explorer(page, "GB/s", "communicate every", "11_period_explorer",
                                         within=".period-explorer")
    period = page.locator(".period-explorer").first.locator(
        ".widget-slider", has=page.locator("label", has_text="period H")).first

    def move(slider, column, top):
        shown = _period_numbers(text.inner_text())
        back = shown[column] >= top  # at the slider's end: down, and the times must grow
        # one key at a time, each answered before the next: with two keys pressed at once, a loaded kernel
        # can answer the first, go idle and answer the second only later (CI read the text in between)
        for _ in range(2):
            before, src = text.inner_text(), picture.get_attribute("src")
            _press(page, slider, "ArrowLeft" if back else "ArrowRight", 1)
            _wait_changed(page, text, "innerText", before)
            _wait_changed(page, picture, "src", src)
        moved = _period_numbers(text.inner_text())
        assert moved[1 - column] == shown[1 - column], (shown, moved)  # the other control stays where it was
        assert (moved[column] < shown[column]) if back else (moved[column] > shown[column]), (shown, moved)
        return shown, moved, back

    # two steps up the log scale, 0.05 each: the all-reduce takes less time, so local SGD's step does not grow
    # (its share of the all-reduce can be below the 0.001 ms shown)
    shown, moved, back = move(bandwidth, 1, 1000)
    assert (moved[3] > shown[3] and moved[2] >= shown[2]) if back else (moved[3] < shown[3] and moved[2] <= shown[2]), \
        (shown, moved)
    # two stops of the period slider (H x 4, or / 4): the same all-reduce, shared by more steps
    shown, moved, back = move(period, 0, 1024)
    assert moved[3] == shown[3] and ((moved[2] > shown[2]) if back else (moved[2] < shown[2])), (shown, moved)
    page.screenshot(path=str(SHOTS / "11_period_explorer.after.png"))
