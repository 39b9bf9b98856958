"""E2B's code interpreter results, through E2B's own SDKs (pinned: e2b 2.63.0,
e2b-code-interpreter 2.11.5, @e2b/code-interpreter 2.8.0), written as an E2B user's code is:
`text` as E2B's server makes it, `result.chart` from matplotlib figures (every chart type E2B's
kernel extracts, with its axes and scales), `result.data` for DataFrames, PIL images
displayed, and `run_code(envs=...)` for one execution, restored however it ends.

Where the E2B behaviour comes from (read in E2B's public sources):
- text: code-interpreter template/server/api/models/result.py (`Result.__init__` takes one
  pair of enclosing quotes off text/plain);
- chart, data: template/startup_scripts/0002_data.py (formatters `e2b/chart`, `e2b/data`)
  and chart_data_extractor/e2b_charts (the chart shapes); the SDK's
  e2b_code_interpreter/charts.py reads them;
- PIL: template/startup_scripts/0003_images.py;
- envs: template/server/messaging.py (`ContextWebSocket.execute`: set before the code, a
  cleanup execution after it).
"""

import ast
import asyncio
import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
import requests

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

HERE = Path(__file__).parent
JS_DIR = HERE / "e2b-js"
PNG = b"\x89PNG\r\n\x1a\n"


def only(results):
    assert len(results) == 1, [r.formats() for r in results]
    return results[0]


# --- text -----------------------------------------------------------------------------


def test_text_is_what_e2bs_server_returns(e2b_env):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        assert sbx.run_code("'abc'").text == "abc"
        assert sbx.run_code('"double"').text == "double"
        assert sbx.run_code("\"it's\"").text == "it's"
        assert sbx.run_code("1 + 1").text == "2"
        assert sbx.run_code("3.5").text == "3.5"
        assert sbx.run_code("[1, 'a']").text == "[1, 'a']"
        # Whole, not shortened past 1000 items as IPython does (E2B: max_seq_length = 0).
        text = sbx.run_code("list(range(1500))").text
        assert "..." not in text and ast.literal_eval(text) == list(range(1500))
        ex = sbx.run_code("None")
        assert ex.results == [] and ex.text is None
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
        assert ex.text == "   a  b\n0  1  x\n1  2  y"
        # Displays too: E2B's server makes every result's text the same way.
        ex = sbx.run_code("from IPython.display import display\ndisplay('shown')\n7")
        assert [r.text for r in ex.results] == ["shown", "7"]
        assert [r.is_main_result for r in ex.results] == [False, True]


def test_lists_and_dicts_have_json(e2b_env):
    """E2B's kernel formats lists and dicts as application/json too (its E2BJSONFormatter)."""
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        r = only(sbx.run_code("[1, 'a', None]").results)
        assert r.json == [1, "a", None] and r.text == "[1, 'a', None]"
        r = only(sbx.run_code("import numpy as np, datetime\n{1: np.int64(2), 'd': datetime.date(2024, 1, 2), 'a': np.arange(3)}").results)
        assert r.json == {"1": 2, "d": "2024-01-02", "a": [0, 1, 2]}
        # Not JSON: no json, the text as before.
        r = only(sbx.run_code("[float('nan')]").results)
        assert r.json is None and r.text == "[nan]"
        r = only(sbx.run_code("{'s': {1, 2}}").results)
        assert r.json is None
        assert only(sbx.run_code("(1, 2)").results).json is None


def test_text_with_the_async_sdk(e2b_env):
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            assert (await sbx.run_code("'abc'")).text == "abc"
            assert (await sbx.run_code("40 + 2")).text == "42"
            assert (await sbx.run_code("None")).results == []
        finally:
            await sbx.kill()

    asyncio.run(main())


# --- charts ---------------------------------------------------------------------------

CHARTS = r'''
import datetime
import matplotlib.pyplot as plt
'''


def chart_of(sbx, code):
    """The one result a figure makes: its PNG and its chart, in one display."""
    ex = sbx.run_code("import matplotlib.pyplot as plt\n" + code + "\nplt.show()")
    assert ex.error is None, ex.error
    r = only(ex.results)
    assert r.png and base64.b64decode(r.png).startswith(PNG)
    assert r.chart is not None, r.formats()
    return r.chart


def check_charts(sbx):
    from e2b_code_interpreter.charts import (
        BarChart,
        BoxAndWhiskerChart,
        ChartType,
        LineChart,
        PieChart,
        ScaleType,
        ScatterChart,
        SuperChart,
    )

    c = chart_of(
        sbx,
        "fig, ax = plt.subplots()\n"
        "ax.plot([1, 2, 3], [2, 4, 9], label='growth')\n"
        "ax.plot([1, 2, 3], [1, 1.5, 2])\n"
        "ax.set_title('Growth')\nax.set_xlabel('Time (s)')\nax.set_ylabel('Distance [m]')\n"
        "ax.grid(True)",
    )
    assert isinstance(c, LineChart) and c.type == ChartType.LINE
    assert c.title == "Growth"
    assert (c.x_label, c.y_label, c.x_unit, c.y_unit) == ("Time (s)", "Distance [m]", "s", "m")
    assert [e.label for e in c.elements] == ["growth", "Line 1"]
    assert c.elements[0].points == [(1.0, 2.0), (2.0, 4.0), (3.0, 9.0)]
    assert c.x_scale == ScaleType.LINEAR and c.y_scale == ScaleType.LINEAR
    assert c.x_ticks and len(c.x_ticks) == len(c.x_tick_labels)
    assert all(isinstance(t, float) for t in c.x_ticks)

    c = chart_of(
        sbx,
        "fig, ax = plt.subplots()\n"
        "ax.scatter([1, 2, 3], [3, 1, 2], label='A')\nax.scatter([4, 5], [0, 1], label='B')",
    )
    assert isinstance(c, ScatterChart) and c.type == ChartType.SCATTER
    assert [(e.label, e.points) for e in c.elements] == [
        ("A", [(1.0, 3.0), (2.0, 1.0), (3.0, 2.0)]),
        ("B", [(4.0, 0.0), (5.0, 1.0)]),
    ]

    c = chart_of(
        sbx,
        "fig, ax = plt.subplots()\n"
        "ax.bar(['Oslo', 'Rome', 'Cairo'], [4, 19, 30], label='temp')\n"
        "ax.set_title('Temperatures')\nax.set_xlabel('City')\nax.set_ylabel('Temp (C)')",
    )
    assert isinstance(c, BarChart) and c.type == ChartType.BAR
    assert c.title == "Temperatures" and c.y_unit == "C"
    assert [(e.label, e.group, e.value) for e in c.elements] == [
        ("Oslo", "temp", 4.0),
        ("Rome", "temp", 19.0),
        ("Cairo", "temp", 30.0),
    ]

    # Horizontal bars: the categories are on the y axis, the labels swap.
    c = chart_of(
        sbx,
        "fig, ax = plt.subplots()\nax.barh(['a', 'b'], [3, 5])\n"
        "ax.set_xlabel('Count')\nax.set_ylabel('Letter')",
    )
    assert isinstance(c, BarChart)
    assert (c.x_label, c.y_label) == ("Letter", "Count")
    assert [(e.label, e.group, e.value) for e in c.elements] == [("a", "Group 0", 3.0), ("b", "Group 0", 5.0)]

    c = chart_of(
        sbx,
        "fig, ax = plt.subplots()\nax.pie([1, 2, 3], labels=['x', 'y', 'z'])\nax.set_title('Shares')",
    )
    assert isinstance(c, PieChart) and c.type == ChartType.PIE and c.title == "Shares"
    assert [(e.label, e.angle, e.radius) for e in c.elements] == [
        ("x", 60.0, 1.0),
        ("y", 120.0, 1.0),
        ("z", 180.0, 1.0),
    ]

    c = chart_of(
        sbx,
        "fig, ax = plt.subplots()\n"
        "ax.boxplot([[85, 90, 78, 92, 88], [95, 89, 76, 91, 84, 87, 40]],\n"
        "           tick_labels=['A', 'B'], patch_artist=True)\n"
        "ax.set_xlabel('Class')\nax.set_ylabel('Score')",
    )
    assert isinstance(c, BoxAndWhiskerChart) and c.type == ChartType.BOX_AND_WHISKER
    assert (c.x_label, c.y_label) == ("Class", "Score")
    got = [(e.label, e.min, e.first_quartile, e.median, e.third_quartile, e.max, e.outliers) for e in c.elements]
    assert got == [
        ("A", 78.0, 85.0, 88.0, 90.0, 92.0, []),
        ("B", 76.0, 80.0, 87.0, 90.0, 95.0, [40.0]),
    ]

    # Scales: log, datetime, categorical.
    c = chart_of(sbx, "fig, ax = plt.subplots()\nax.plot([1, 10, 100], [1, 100, 10000])\nax.set_yscale('log')")
    assert c.y_scale == ScaleType.LOG and c.x_scale == ScaleType.LINEAR
    c = chart_of(
        sbx,
        "import datetime\nfig, ax = plt.subplots()\n"
        "ax.plot([datetime.date(2024, 1, d) for d in (1, 2, 3)], [5, 6, 7])",
    )
    assert c.x_scale == ScaleType.DATETIME
    assert c.elements[0].points[0] == ("2024-01-01", 5.0)
    assert all(isinstance(t, str) and t.startswith("2024-01-") for t in c.x_ticks)
    c = chart_of(sbx, "fig, ax = plt.subplots()\nax.plot(['mon', 'tue', 'wed'], [3, 1, 2])")
    assert c.x_scale == ScaleType.CATEGORICAL
    assert c.x_tick_labels == ["mon", "tue", "wed"]
    assert c.elements[0].points == [("mon", 3.0), ("tue", 1.0), ("wed", 2.0)]

    # Several axes: a superchart of the charts.
    c = chart_of(
        sbx,
        "fig, (a, b) = plt.subplots(1, 2)\na.plot([1, 2], [3, 4])\nb.bar(['p', 'q'], [1, 2])\n"
        "fig.suptitle('Both')",
    )
    assert isinstance(c, SuperChart) and c.type == ChartType.SUPERCHART and c.title == "Both"
    assert [type(e) for e in c.elements] == [LineChart, BarChart]

    # Something else drawn: the chart says unknown, the PNG is there.
    c = chart_of(sbx, "fig, ax = plt.subplots()\nax.imshow([[1, 2], [3, 4]])")
    assert c.type == ChartType.UNKNOWN

    # A blank figure and one past the bound: the PNG alone.
    for code in ("fig, ax = plt.subplots()", "fig, ax = plt.subplots()\nax.plot(range(200_000))"):
        ex = sbx.run_code("import matplotlib.pyplot as plt\n" + code + "\nplt.show()")
        r = only(ex.results)
        assert r.png and r.chart is None, r.formats()


def test_charts_from_matplotlib_figures(any_backend):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=300) as sbx:
        check_charts(sbx)


def test_a_failing_extraction_leaves_the_png(e2b_env):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        chart_of(sbx, "plt.plot([1, 2], [3, 4])")
        # A figure whose axes break the extraction (a label getter that raises): the
        # display is still made, with its PNG and without a chart.
        ex = sbx.run_code(
            "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2], [3, 4])\n"
            "def boom(*a, **k):\n    raise RuntimeError('no labels')\n"
            "ax.get_xlabel = boom\nplt.show()"
        )
        assert ex.error is None, ex.error
        r = only(ex.results)
        assert r.png and r.chart is None


def test_a_hostile_kernels_chart_and_data_are_passed_or_dropped(e2b_env):
    """What the kernel sends is untrusted: bundles it makes up itself reach the SDK as E2B's
    would (objects passed on, anything else left out), and the broker carries on."""
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        ex = sbx.run_code(
            "from IPython.display import display\n"
            "display({'text/plain': 'a', 'e2b/chart': 'garbage', 'e2b/data': [1, 2]}, raw=True)\n"
            "display({'text/plain': 'b', 'e2b/chart': {'type': 'nonsense'}, 'e2b/data': {'k': [1]}}, raw=True)\n"
            "display({'text/plain': 'c', 'e2b/chart': {'nested': [[[[[]]]]] * 1000}}, raw=True)\n"
            "display({'text/plain': 'd', 'e2b/chart': {'type': 'line', 'title': 't', 'elements': 7}}, raw=True)"
        )
        assert ex.error is None, ex.error
        assert [r.text for r in ex.results] == ["a", "b", "c", "d"]
        a, b, c, d = ex.results
        assert a.chart is None and a.data is None and "e2b/chart" not in (a.extra or {})
        # Objects the SDK cannot read as a chart: it says so in its log and has no chart.
        assert b.chart is None and b.data == {"k": [1]}
        assert c.chart is None and d.chart is None
        assert sbx.run_code("1 + 1").text == "2"


def test_charts_with_the_async_sdk(e2b_env):
    from e2b_code_interpreter import AsyncSandbox
    from e2b_code_interpreter.charts import BarChart

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            # No plt.show(): the figure is shown at the end of the cell, chart and all.
            ex = await sbx.run_code("import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 3]);")
            r = only(ex.results)
            assert isinstance(r.chart, BarChart) and r.png
            assert [e.value for e in r.chart.elements] == [1.0, 3.0]
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_only_e2b_executions_get_e2b_formats(e2b_env):
    """The same kernel through the agent REST API: plain IPython bundles, no E2B entries."""
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        code = (
            "import matplotlib.pyplot as plt, pandas as pd\nplt.plot([1, 2])\nplt.show()\n"
            "pd.DataFrame({'a': [1]})"
        )
        r = e2b_env.api("POST", f"/v1/sessions/{sbx.sandbox_id}/execute", json={"code": code})
        assert r.status_code == 200, r.text
        body = r.text
        assert "image/png" in body and "text/html" in body
        assert "e2b/chart" not in body and "e2b/data" not in body
        r = e2b_env.api("POST", f"/v1/sessions/{sbx.sandbox_id}/execute", json={"code": "[1, 2]"})
        assert "application/json" not in r.text, r.text
        r = e2b_env.api("POST", f"/v1/sessions/{sbx.sandbox_id}/execute", json={"code": "list(range(1500))"})
        assert "..." in r.text
        # And E2B's, right after, on the same kernel.
        ex = sbx.run_code(code)
        assert [bool(x.chart) for x in ex.results] == [True, False]
        assert ex.results[1].data == {"a": [1]}


# --- DataFrames -----------------------------------------------------------------------


def test_dataframes_have_data(e2b_env):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        ex = sbx.run_code(
            "import pandas as pd\n"
            "pd.DataFrame({'city': ['Oslo', 'Rome'], 'temp': [4.5, None],\n"
            "              'day': pd.to_datetime(['2024-01-01', '2024-01-02'])})"
        )
        r = only(ex.results)
        assert r.is_main_result and r.html and "Oslo" in r.text
        assert r.data == {
            "city": ["Oslo", "Rome"],
            "temp": [4.5, None],
            "day": ["2024-01-01T00:00:00", "2024-01-02T00:00:00"],
        }
        assert "data" in r.formats()
        # Displayed, not only the last expression.
        ex = sbx.run_code("from IPython.display import display\ndisplay(pd.DataFrame({'n': [1, 2]}))")
        assert only(ex.results).data == {"n": [1, 2]}
        # A Series is not a DataFrame: no data.
        assert only(sbx.run_code("pd.Series([1, 2])").results).data is None
        # In a context of its own (another kernel of the sandbox) too.
        ctx = sbx.create_code_context()
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'c': ['z']})", context=ctx)
        assert only(ex.results).data == {"c": ["z"]}
        ex = sbx.run_code("import os\nos.environ['KB_CTX']", context=ctx, envs={"KB_CTX": "ctx"})
        assert ex.text == "ctx"
        # Past the bound (100 000 cells): the frame as IPython shows it, without data.
        ex = sbx.run_code("pd.DataFrame({'a': range(200_000)})")
        r = only(ex.results)
        assert r.data is None and r.text and r.html


# --- PIL ------------------------------------------------------------------------------


def test_pil_images_display(e2b_env):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        ex = sbx.run_code("from PIL import Image\nimg = Image.new('RGB', (8, 6), 'red')\nimg.show()")
        assert ex.error is None, ex.error
        r = only(ex.results)
        assert not r.is_main_result
        assert base64.b64decode(r.png).startswith(PNG)
        # As the last expression.
        r = only(sbx.run_code("img").results)
        assert r.is_main_result and base64.b64decode(r.png).startswith(PNG)
        # Saved to a path: displayed, and the file is written.
        ex = sbx.run_code("img.save('red.png')")
        assert base64.b64decode(only(ex.results).png).startswith(PNG)
        assert bytes(sbx.files.read("red.png", format="bytes")).startswith(PNG)
        # To a file object: written only, as in E2B.
        ex = sbx.run_code("import io\nimg.save(io.BytesIO(), format='PNG')")
        assert ex.results == []


# --- envs -----------------------------------------------------------------------------

READ = "import os\n(os.environ.get('KB_NEW'), os.environ.get('KB_OLD'), os.environ.get('KB_SBX'))"


def check_envs(sbx):
    from e2b.exceptions import TimeoutException

    def state():
        return sbx.run_code(READ).text

    sbx.run_code("import os\nos.environ['KB_OLD'] = 'kernel'")
    before = "(None, 'kernel', 'sandbox')"
    assert state() == before
    envs = {"KB_NEW": "new", "KB_OLD": "changed", "KB_SBX": "changed too"}

    # Set for the execution (its subprocesses too), restored after it.
    shell = "import subprocess\nprint(subprocess.run(['sh', '-c', 'echo $KB_NEW'], capture_output=True, text=True).stdout, end='')\n"
    ex = sbx.run_code(shell + READ, envs=envs)
    assert ex.error is None, ex.error
    assert ex.text == "('new', 'changed', 'changed too')"
    assert ex.logs.stdout == ["new\n"]
    assert state() == before

    # An execution that fails.
    ex = sbx.run_code("import os\nassert os.environ['KB_NEW'] == 'new'\n1 / 0", envs=envs)
    assert ex.error.name == "ZeroDivisionError"
    assert state() == before

    # Interrupted: the SDK's timeout closes the request, the broker interrupts the code.
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(30)", envs=envs, timeout=2)
    assert sbx.run_code(READ, timeout=30).text == before

    # Hostile: the code removes every hook it can find, and changes the variables itself.
    ex = sbx.run_code(
        "import sys, os\n"
        "ip = get_ipython()\n"
        "k = ip.kernel\n"
        "k.__dict__.pop('do_execute', None)\n"
        "sys.modules.pop('kernel_broker_e2b', None)\n"
        "ip.display_formatter.formatters.pop('e2b/chart', None)\n"
        "os.environ['KB_NEW'] = 'mine'\n"
        "os.environ['KB_SBX'] = 'mine'\n",
        envs=envs,
    )
    assert ex.error is None, ex.error
    assert state() == before
    # With the hooks gone from this kernel, an execution's variables cannot be applied:
    # the output says so (never silently).
    ex = sbx.run_code(READ, envs={"KB_NEW": "x"})
    assert ex.text == "(None, 'kernel', 'sandbox')"
    assert "were not applied" in "".join(ex.logs.stderr)
    # A restarted kernel has them again.
    sbx.restart_code_context(sbx.list_code_contexts()[0])
    assert sbx.run_code("import os\nos.environ['KB_NEW']", envs={"KB_NEW": "back"}).text == "back"
    assert sbx.run_code("import os\nos.environ.get('KB_NEW')").results == []

    # Refused before anything runs, as create's envVars are: 400.
    huge = "x" * (1 << 20)
    for bad in ({"LD_PRELOAD": "/tmp/x.so"}, {"1BAD": "x"}, {"A B": "x"}, {"NUL": "a\0b"}, {"BIG": huge},
                {f"V{i}": "x" for i in range(300)}):
        with pytest.raises(e2b.SandboxException) as info:
            sbx.run_code("import os\nos.environ['KB_RAN'] = '1'", envs=bad)
        assert "400" in str(info.value) and "envs" in str(info.value), info.value
    assert sbx.run_code("import os\nos.environ.get('KB_RAN')").results == []


def test_envs_for_one_execution(any_backend):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=300, envs={"KB_SBX": "sandbox"}) as sbx:
        check_envs(sbx)


def test_envs_are_restored_after_the_brokers_timeout(fresh_broker, monkeypatch):
    """The broker's own execution timeout interrupts the code: the variables are back."""
    from conftest import ALICE
    from e2b_code_interpreter import Sandbox

    b = fresh_broker(extra_args=["--max-execution-timeout", "2"])
    monkeypatch.setenv("E2B_API_URL", b.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", b.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    with Sandbox.create(timeout=60) as sbx:
        ex = sbx.run_code("import time\ntime.sleep(30)", envs={"KB_T": "during"}, timeout=20)
        assert ex.error is not None and ex.error.name in ("TimeoutError", "KeyboardInterrupt"), ex.error
        assert sbx.run_code("import os\nos.environ.get('KB_T')").results == []


def test_envs_with_the_async_sdk(e2b_env):
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            ex = await sbx.run_code("import os\nos.environ['KB_A']", envs={"KB_A": "async"})
            assert ex.text == "async"
            ex = await sbx.run_code("import os\nos.environ.get('KB_A')")
            assert ex.results == []
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_env_vars_that_are_not_text_are_refused(e2b_env):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=60) as sbx:
        url = os.environ["E2B_SANDBOX_URL"] + "/execute"
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
        for bad in ({"A": 1}, {"A": None}, {"A": ["x"]}, "A=1"):
            r = requests.post(url, headers=headers, json={"code": "1", "env_vars": bad}, timeout=30)
            assert r.status_code in (400, 422), (bad, r.status_code, r.text)


# --- JavaScript -----------------------------------------------------------------------


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk_interpreter(e2b_env):
    r = subprocess.run(
        ["node", str(JS_DIR / "interpreter.mjs")], cwd=JS_DIR, env=dict(os.environ),
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["text"] == "abc"
    assert report["int"] == "2"
    assert report["none"] == 0
    assert report["json"] == {"k": [1, 2]}
    chart = report["chart"]
    assert chart["type"] == "bar" and chart["title"] == "T"
    assert [(e["label"], e["value"]) for e in chart["elements"]] == [("a", 1.0), ("b", 3.0)]
    assert report["chartPng"] is True and report["figureResults"] == 1
    assert sorted(report["contexts"]) == [[False, "/home/user"], [True, "/tmp"]]
    assert report["line"]["type"] == "line" and report["line"]["x_scale"] == "categorical"
    assert report["data"] == {"a": [1, 2], "b": ["x", "y"]}
    assert report["pil"] is True
    assert report["envInside"] == "js-value"
    assert report["envAfter"] == 0
    assert report["badEnv"].startswith("SandboxError") or "400" in report["badEnv"], report["badEnv"]


# --- kernels started without the fork server --------------------------------------------


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_kernels_started_plainly_have_e2bs_formats(backend, fresh_broker, monkeypatch):
    """With the fork server off (`--fork-server false`; on Docker the plain exec path), a
    sandbox's kernel and its contexts' kernels start through the bootstrap script's `kernel`
    mode: charts, DataFrame data, PIL display and one execution's envs as from a fork."""
    from conftest import ALICE, _docker_usable
    from e2b_code_interpreter import Sandbox

    args = ["--fork-server", "false"]
    if backend == "docker":
        if not _docker_usable():
            pytest.skip("Docker or the kernel image (docker/build.sh) is missing")
        args += ["--sandbox", "docker"]
    b = fresh_broker(extra_args=args)
    monkeypatch.setenv("E2B_API_URL", b.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", b.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    with Sandbox.create(timeout=300) as sbx:
        ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.title('T')\nplt.show()")
        r = only(ex.results)
        assert r.chart is not None and r.chart.title == "T", r.formats()
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'n': [1, 2]})")
        assert only(ex.results).data == {"n": [1, 2]}
        ex = sbx.run_code("from PIL import Image\nImage.new('RGB', (2, 2)).show()")
        assert base64.b64decode(only(ex.results).png).startswith(PNG)
        ex = sbx.run_code("import os\nos.environ.get('KB_ONE')", envs={"KB_ONE": "one"})
        assert ex.text == "one"
        assert sbx.run_code("import os\nos.environ.get('KB_ONE')").text is None
        # A context's kernel starts plainly too.
        ctx = sbx.create_code_context()
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'c': ['z']})", context=ctx)
        assert only(ex.results).data == {"c": ["z"]}


# --- contexts -----------------------------------------------------------------------------


def test_contexts_are_listed_with_their_working_directory(e2b_env):
    """E2B's server lists each context with the cwd it was created with
    (template/server/main.py's `/contexts`, from contexts.py's `create_context`)."""
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        sbx.files.make_dir("sub")
        sub = sbx.create_code_context(cwd="/home/user/sub")
        tmp = sbx.create_code_context(cwd="/tmp")
        home = sbx.create_code_context()
        listed = {c.id: c.cwd for c in sbx.list_code_contexts()}
        assert listed[sub.id] == "/home/user/sub"
        assert listed[tmp.id] == "/tmp"
        assert listed[home.id] == "/home/user"
        assert len(listed) == 4  # and the sandbox's default context
        # A removed context leaves the list; the others keep their directories.
        sbx.remove_code_context(tmp)
        listed = {c.id: c.cwd for c in sbx.list_code_contexts()}
        assert tmp.id not in listed and listed[sub.id] == "/home/user/sub"
        # A refused directory adds nothing.
        with pytest.raises(Exception):
            sbx.create_code_context(cwd="/home/user/missing")
        assert len(sbx.list_code_contexts()) == 3
