"""What a new user sees when the broker starts: one ready line naming the API, the session
browser and the docs, and plain-text logs when stderr is not a terminal (a pipe here)."""
import re

from conftest import Broker


def test_the_ready_line_names_every_entry_point_and_logs_are_plain():
    b = Broker()
    try:
        log = "".join(b.log)
        ready = next(line for line in b.log if "ready on http://" in line)
        for path in ("/v1/sessions", "/ui/", "/api/kernels", "/openapi.json"):
            assert f"{b.url}{path}" in ready, ready
        assert "docs/API.md" in ready
        assert "\x1b[" not in log, "ANSI colour codes in a log written to a pipe"
        assert re.match(r"^\d{4}-\d\d-\d\dT", ready), ready
    finally:
        b.stop()
