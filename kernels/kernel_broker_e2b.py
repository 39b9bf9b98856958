"""kernel-broker's E2B-shaped kernel: what E2B's code-interpreter kernel adds to IPython,
active only in executions the broker's E2B front door sends.

The broker writes this file next to ``kernel_broker_boot.py`` (a directory no kernel can
write); the boot script imports it in the fork-server template and calls :func:`install`
in every kernel once its shell exists. It then adds:

``e2b/chart``
    a display formatter that turns a matplotlib figure into structured chart data (line,
    scatter, bar, pie, box-and-whisker, several axes as a "superchart"; their axes' labels,
    units, ticks and scales), the shape E2B's SDKs read as ``result.chart``. It is one more
    entry in the figure's display bundle: the figure is sent once, PNG and chart together.
``e2b/data``
    a display formatter that turns a pandas DataFrame into ``{column: [values]}``
    (timestamps as ISO 8601), E2B's ``result.data``.
``application/json`` for lists and dicts
    E2B's ``result.json``: a list or dict (numpy values, dates and non-string keys made
    JSON) up to 1 MiB of JSON; IPython's own formatter otherwise.
whole sequences
    a list's ``text`` is not shortened past 1000 items (E2B's ``max_seq_length = 0``).
PIL images
    ``Image.show()`` displays the image (PNG) instead of asking a desktop viewer, and
    ``Image.save(path)`` displays it too, as E2B's kernel does.
one execution's environment
    an execution whose request carries ``metadata.kernel_broker.env`` runs with those
    variables set, and the previous values (or their absence) are put back when it ends,
    however it ends: the restore is a ``finally`` around the kernel's own ``do_execute``,
    on the stack before the user's code runs, so nothing that code does (removing this
    module, the wrapper, the formatters) can skip it.

The E2B behaviours apply only while an execution whose request carries
``metadata.kernel_broker.e2b`` runs: Jupyter and REST clients of the same kernel see plain
IPython. Every extraction is bounded (points, cells) and any failure leaves the display as
IPython would have made it: a formatter that fails returns nothing, never an error.
"""

import math
import os
import re
import sys

# Bounds: past them the figure or frame is shown as IPython shows it, without the E2B data.
MAX_CHART_POINTS = 100_000
MAX_DATA_CELLS = 100_000
MAX_JSON_BYTES = 1 << 20

_state = {"e2b": False}


def e2b_active():
    return _state["e2b"]


# --- charts -----------------------------------------------------------------------------


class _TooLarge(Exception):
    pass


class _Budget:
    def __init__(self, limit):
        self.left = limit

    def take(self, n):
        self.left -= n
        if self.left < 0:
            raise _TooLarge()


def _rounded(x):
    """A float without the noise of the drawing's arithmetic: 8 significant digits around
    the number's magnitude, as E2B's charts report box and pie values."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    magnitude = math.floor(math.log10(abs(x)))
    digits = max(1, 8 - magnitude)
    return float("%.*g" % (digits, x))


def _text_or_none(s):
    return s if s else None


_UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")


def _unit(label):
    if not label:
        return None
    m = _UNIT.search(label)
    if not m:
        return None
    return m.group(1) or m.group(2)


def _converter(axis):
    get = getattr(axis, "get_converter", None)
    return get() if get is not None else getattr(axis, "converter", None)


def _is_date_converter(conv):
    import matplotlib.dates as mdates

    kinds = tuple(
        k
        for k in (
            getattr(mdates, "_SwitchableDateConverter", None),
            getattr(mdates, "DateConverter", None),
            getattr(mdates, "ConciseDateConverter", None),
        )
        if k is not None
    )
    return conv is not None and isinstance(conv, kinds)


def _point_value(v):
    import datetime

    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(v, np.datetime64):
            return str(v.astype("datetime64[s]"))
        if isinstance(v, np.generic):
            v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return str(v)


def _ticks(axis, ticks):
    import matplotlib.dates as mdates

    if _is_date_converter(_converter(axis)):
        return [mdates.num2date(t).isoformat() for t in ticks]
    return [_point_value(t) for t in ticks]


def _scale(axis, scale, ticks, labels):
    if _is_date_converter(_converter(axis)):
        return "datetime"
    if scale != "linear":
        return scale
    # Ticks 0..n-1 whose labels are not those numbers: categories.
    for i, (tick, label) in enumerate(zip(ticks, labels)):
        if not (isinstance(tick, float) and tick == i and str(i) != label):
            return "linear"
    return "categorical"


def _base(kind, ax):
    return {"type": kind, "title": _text_or_none(ax.get_title()), "elements": []}


def _planar(kind, ax):
    chart = _base(kind, ax)
    x_label = _text_or_none(ax.get_xlabel())
    y_label = _text_or_none(ax.get_ylabel())
    chart.update(x_label=x_label, y_label=y_label, x_unit=_unit(x_label), y_unit=_unit(y_label))
    return chart


def _swap_axes(chart):
    chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
    chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]


def _with_ticks(chart, ax):
    for name, axis, scale in (("x", ax.xaxis, ax.get_xscale()), ("y", ax.yaxis, ax.get_yscale())):
        labels = [t.get_text() for t in axis.get_ticklabels()]
        ticks = _ticks(axis, axis.get_ticklocs())
        chart[name + "_ticks"] = ticks
        chart[name + "_tick_labels"] = labels
        chart[name + "_scale"] = _scale(axis, scale, ticks, labels)
    return chart


def _is_grid_line(line):
    xs, ys = line.get_xdata(), line.get_ydata()
    if len(xs) != 2 or len(ys) != 2:
        return False
    return bool(xs[0] == xs[1] or ys[0] == ys[1])


def _line_chart(ax, budget):
    chart = _with_ticks(_planar("line", ax), ax)
    for line in ax.get_lines():
        if _is_grid_line(line):
            continue
        label = line.get_label()
        if label.startswith("_child") and label[6:].isdigit():
            label = "Line %d" % int(label[6:])
        xs, ys = line.get_xdata(), line.get_ydata()
        budget.take(len(xs))
        points = [[_point_value(x), _point_value(y)] for x, y in zip(xs, ys)]
        chart["elements"].append({"label": label, "points": points})
    return chart


def _scatter_chart(ax, budget):
    chart = _with_ticks(_planar("scatter", ax), ax)
    for collection in ax.collections:
        offsets = collection.get_offsets()
        budget.take(len(offsets))
        points = [[_point_value(x), _point_value(y)] for x, y in offsets]
        chart["elements"].append({"label": collection.get_label(), "points": points})
    return chart


def _bar_chart(ax, budget):
    chart = _planar("bar", ax)
    swapped = False
    for container in ax.containers:
        group = container.get_label()
        if group.startswith("_container") and group[10:].isdigit():
            group = "Group %d" % int(group[10:])
        bars = list(container)
        budget.take(len(bars))
        heights = [b.get_height() for b in bars]
        if heights and all(h == heights[0] for h in heights):
            # Equal heights: horizontal bars (barh), the categories on the y axis.
            if not swapped:
                _swap_axes(chart)
                swapped = True
            labels = [t.get_text() for t in ax.get_yticklabels()]
            values = [b.get_width() for b in bars]
        else:
            labels = [t.get_text() for t in ax.get_xticklabels()]
            values = heights
        for label, value in zip(labels, values):
            chart["elements"].append({"label": label, "group": group, "value": float(value)})
    return chart


def _pie_chart(ax, budget):
    chart = _base("pie", ax)
    budget.take(len(ax.patches))
    for wedge in ax.patches:
        chart["elements"].append(
            {
                "label": wedge.get_label(),
                "angle": abs(_rounded(float(wedge.theta2) - float(wedge.theta1))),
                "radius": float(wedge.r),
            }
        )
    return chart


def _box_chart(ax, budget):
    chart = _planar("box_and_whisker", ax)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    boxes = []
    for label, patch in zip(labels, ax.patches):
        vertices = patch.get_path().vertices
        xs = [_rounded(v) for v in vertices[:, 0]]
        ys = [_rounded(v) for v in vertices[:, 1]]
        x, y = min(xs), min(ys)
        boxes.append(
            {"label": label, "x": x, "y": y, "w": max(xs) - x, "h": max(ys) - y, "outliers": []}
        )
    if not boxes:
        return chart
    budget.take(len(boxes) + len(ax.lines))
    horizontal = all(b["h"] == boxes[0]["h"] for b in boxes)
    if horizontal:
        # Boxes of one height: drawn sideways (vert=False); read them the other way round.
        _swap_axes(chart)
        for b in boxes:
            b["x"], b["y"], b["w"], b["h"] = b["y"], b["x"], b["h"], b["w"]

    def box_at(x0, x1):
        for b in boxes:
            if b["x"] <= x0 <= x1 <= b["x"] + b["w"]:
                return b
        return None

    for line in ax.lines:
        xs = [_rounded(v) for v in line.get_xdata()]
        ys = [_rounded(v) for v in line.get_ydata()]
        if horizontal:
            xs, ys = ys, xs
        if len(xs) == 1:
            # A flier: an outlier of the box it stands in.
            b = box_at(xs[0], xs[0])
            if b is not None:
                b["outliers"].append(ys[0])
            continue
        if len(xs) != 2 or len(ys) != 2:
            continue
        b = box_at(xs[0], xs[1])
        if b is None:
            continue
        if ys[0] == ys[1] and b["y"] <= ys[0] <= b["y"] + b["h"]:
            b["median"] = ys[0]
            continue
        low, high = min(ys), max(ys)
        if high == b["y"]:
            b["min"] = low
        elif low == b["y"] + b["h"]:
            b["max"] = high
    for b in boxes:
        chart["elements"].append(
            {
                "label": b["label"],
                "min": b["min"],
                "first_quartile": b["y"],
                "median": b["median"],
                "third_quartile": b["y"] + b["h"],
                "max": b["max"],
                "outliers": b["outliers"],
            }
        )
    return chart


def _kind(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import PathPatch, Rectangle, Wedge
    from matplotlib.text import Text

    artists = [a for a in _drawn(ax) if not isinstance(a, Text)]
    if all(isinstance(a, Line2D) for a in artists):
        return "line"
    if all(isinstance(a, (PathPatch, Line2D)) for a in artists):
        return "box_and_whisker"
    artists = [a for a in artists if not (isinstance(a, Line2D) and _is_grid_line(a))]
    if all(isinstance(a, PathCollection) for a in artists):
        return "scatter"
    if all(isinstance(a, Wedge) for a in artists):
        return "pie"
    if all(isinstance(a, Rectangle) for a in artists):
        return "bar"
    return "unknown"


def _drawn(ax):
    # What was drawn on the axes (lines, patches, collections, texts, images, tables),
    # not its spines, axes and background.
    children = getattr(ax, "_children", None)
    if children is None:
        return list(ax.lines) + list(ax.patches) + list(ax.collections) + list(ax.texts)
    return list(children)


_BUILDERS = {
    "line": _line_chart,
    "scatter": _scatter_chart,
    "bar": _bar_chart,
    "pie": _pie_chart,
    "box_and_whisker": _box_chart,
}


def _axes_chart(ax, budget):
    kind = _kind(ax)
    build = _BUILDERS.get(kind)
    if build is None:
        return _base("unknown", ax)
    return build(ax, budget)


def figure_chart(figure):
    """The chart data of a matplotlib figure, or None (blank, too large, not readable)."""
    axes = figure.get_axes()
    if not axes or not any(ax.has_data() for ax in axes):
        return None
    budget = _Budget(MAX_CHART_POINTS)
    try:
        if len(axes) > 1:
            get_suptitle = getattr(figure, "get_suptitle", None)
            title = get_suptitle() if get_suptitle else ""
            return {
                "type": "superchart",
                "title": title,
                "elements": [_axes_chart(ax, budget) for ax in axes],
            }
        return _axes_chart(axes[0], budget)
    except _TooLarge:
        return None


# --- formatters -------------------------------------------------------------------------


def _formatter_classes():
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            if not _state["e2b"] or "matplotlib" not in sys.modules:
                return None
            from matplotlib.figure import Figure

            if not isinstance(obj, Figure):
                return None
            try:
                return figure_chart(obj)
            except Exception:
                return None

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if not _state["e2b"] or pandas is None or not isinstance(obj, pandas.DataFrame):
                return None
            try:
                return frame_data(obj, pandas)
            except Exception:
                return None

    return ChartFormatter, DataFormatter


def _json_formatter(original):
    """A subclass of the shell's own application/json formatter: lists and dicts as JSON in
    E2B executions (shown expanded, E2B's metadata), everything else as before."""

    class JsonFormatter(type(original)):
        def __call__(self, obj):
            if _state["e2b"] and isinstance(obj, (list, dict)):
                try:
                    return plain_json(obj), {"expanded": True}
                except Exception:
                    pass
            return super().__call__(obj)

    return JsonFormatter


def _json_default(v):
    import datetime

    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, np.generic):
            return v.item()
    if isinstance(v, (datetime.date, datetime.datetime, datetime.time)):
        return v.isoformat()
    raise TypeError("not JSON")


def plain_json(obj):
    """``obj`` as plain JSON values, or an error (not JSON, NaN, past the bound)."""
    import json

    text = json.dumps(obj, default=_json_default, allow_nan=False)
    if len(text) > MAX_JSON_BYTES:
        raise ValueError("too large")
    return json.loads(text)


def _json_value(v, pandas):
    if isinstance(v, pandas.Timestamp):
        return v.isoformat()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if v is pandas.NaT or (pandas.api.types.is_scalar(v) and pandas.isna(v)):
        return None
    return str(v)


def frame_data(frame, pandas):
    """``{column: [values]}``, the frame as E2B's ``result.data``; None past the bound."""
    if frame.size > MAX_DATA_CELLS:
        return None
    out = {}
    for name, values in frame.to_dict(orient="list").items():
        out[str(name)] = [_json_value(v, pandas) for v in values]
    return out


# --- PIL ----------------------------------------------------------------------------------


def _patch_pil():
    try:
        from PIL import Image
    except Exception:
        return
    if getattr(Image.Image, "_kernel_broker_patched", False):
        return
    from IPython.display import display

    show, save = Image.Image.show, Image.Image.save

    def e2b_show(self, *args, **kwargs):
        if _state["e2b"]:
            display(self)
            return None
        return show(self, *args, **kwargs)

    def e2b_save(self, fp, *args, **kwargs):
        if _state["e2b"] and isinstance(fp, str):
            display(self)
        return save(self, fp, *args, **kwargs)

    Image.Image.show = e2b_show
    Image.Image.save = e2b_save
    Image.Image._kernel_broker_patched = True


# --- one execution's environment ----------------------------------------------------------


def _request_options(kwargs):
    meta = kwargs.get("cell_meta")
    if not isinstance(meta, dict):
        return None
    ours = meta.get("kernel_broker")
    return ours if isinstance(ours, dict) else None


def _wrap_do_execute(kernel, plain_text):
    original = kernel.do_execute
    environ = os.environ

    async def do_execute(*args, **kwargs):
        options = _request_options(kwargs)
        if options is None:
            return await original(*args, **kwargs)
        env = options.get("env")
        env = env if isinstance(env, dict) else {}
        saved = {}
        was = _state["e2b"]
        seq_length = getattr(plain_text, "max_seq_length", None)
        try:
            for key, value in env.items():
                if isinstance(key, str) and isinstance(value, str):
                    saved[key] = environ.get(key)
                    environ[key] = value
            _state["e2b"] = bool(options.get("e2b"))
            if _state["e2b"] and seq_length is not None:
                # E2B's kernel shows sequences whole (`PlainTextFormatter.max_seq_length = 0`).
                plain_text.max_seq_length = 0
            reply = await original(*args, **kwargs)
        finally:
            _state["e2b"] = was
            if seq_length is not None:
                try:
                    plain_text.max_seq_length = seq_length
                except Exception:
                    pass
            for key, value in saved.items():
                try:
                    if value is None:
                        environ.pop(key, None)
                    else:
                        environ[key] = value
                except Exception:
                    pass
        if env and isinstance(reply, dict):
            # Tells the broker the variables were applied (and are restored by now).
            reply["kernel_broker_env"] = "restored"
        return reply

    kernel.do_execute = do_execute


def install(shell, kernel):
    """Adds the E2B behaviours to a kernel (its shell exists); idempotent per kernel."""
    formatters = shell.display_formatter.formatters
    if "e2b/chart" not in formatters:
        chart, data = _formatter_classes()
        formatters["e2b/data"] = data(parent=shell.display_formatter)
        formatters["e2b/chart"] = chart(parent=shell.display_formatter)
        original = formatters.get("application/json")
        if original is not None:
            json_formatter = _json_formatter(original)(parent=shell.display_formatter)
            # Keep what was registered on the original (type printers, enabled).
            json_formatter.type_printers = original.type_printers
            json_formatter.deferred_printers = original.deferred_printers
            json_formatter.enabled = original.enabled
            formatters["application/json"] = json_formatter
    _patch_pil()
    if kernel is not None:
        _wrap_do_execute(kernel, formatters.get("text/plain"))
