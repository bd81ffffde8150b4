"""A prefill links every decode the master lists before any request needs it (so the
first request to a new decode does not pay for the link), and links a decode that joins
later, or restarts, on its own."""
from __future__ import annotations

import pytest

from tests.integration.cluster_harness import Harness, aclient, metric, wait_until
from tests.integration.test_pd_failures import start

pytestmark = pytest.mark.integration


def linked(proc) -> float:
    return metric(proc.http_url, "xllm_pd_linked_instances")


async def test_prefill_links_decodes_before_the_first_request(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "prelink/", tmp_path)
    try:
        svc, prefill, decode = start(h, decode_blocks=256)
        # No request yet: both sides linked (the decode linked the prefill's workers).
        await wait_until(lambda: linked(prefill) == 1 and linked(decode) == 1, 10, step_s=0.1)
        log = (tmp_path / "prefill.log").read_text()
        assert "linked decode" in log and "ahead of requests" in log
        # A decode that joins later is linked too, without traffic.
        late = h.engine("DECODE", "late", extra=["--block-size", "8", "--num-blocks", "256"])
        late.wait_ready(180)
        await wait_until(lambda: linked(prefill) == 2 and linked(late) == 1, 15, step_s=0.1)
        r = await aclient(svc).completions.create(model="tiny", prompt="hello there",
                                                  max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
        assert linked(prefill) == 2  # the request used a link made before it
    finally:
        h.stop()
