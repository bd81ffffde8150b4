"""The engine process's start-up: the heap alive after start-up is frozen out of the GC."""
import gc

from xllm_py.engine.server import freeze_startup_heap


def test_freeze_startup_heap_moves_live_objects_out_of_the_collector():
    survivor = [object() for _ in range(100)]
    assert gc.is_tracked(survivor)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(survivor)
        # A full collection no longer walks it: it is in no collected generation.
        assert not any(o is survivor for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is survivor for o in gc.get_objects())
