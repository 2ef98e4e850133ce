"""Marks shared by the test modules.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). The tests
that run whole pipelines (every service, or a demo, on a real nats-server) carry `E2E`: they
run one after another on one worker, as they would alone on a 2-core machine, while the other
worker takes the rest: two demos at once on 2 cores would each take twice as long.
"""

import pytest

E2E = pytest.mark.xdist_group("e2e")
