"""Fault injection and leak checks for tests and the soak, from outside: the engine itself carries no test hooks."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _HookedRunner:
    """The engine's model runner with `hook` run before each forward pass (inside the step's guard)."""

    def __init__(self, runner: Any, hook: Callable[[], None]) -> None:
        self.runner = runner
        self.hook = hook

    def execute(self, *args, **kwargs):
        self.hook()
        return self.runner.execute(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def set_step_hook(engine: Any, hook: Callable[[], None] | None) -> None:
    """Run `hook` before every forward pass of `engine` (an AsyncEngine or an EngineCore): raising fails
    the step's batch, sleeping slows every step down. None takes the hook away."""
    core = getattr(engine, "core", engine)
    runner = core.runner.runner if isinstance(core.runner, _HookedRunner) else core.runner
    core.runner = runner if hook is None else _HookedRunner(runner, hook)


def assert_blocks_released(engine: Any) -> None:
    """With no request left, no block may be referenced but by a pin (one reference each), and every other
    block must be in the free queue. An engine in another process is judged by the stats of its latest step
    (callers retry until they are fresh)."""
    if not hasattr(engine, "core") and not hasattr(engine, "kv"):
        stats = engine.scheduler_stats()
        assert stats.num_running == 0 and stats.num_waiting == 0, f"{stats.num_running + stats.num_waiting} requests"
        pinned = stats.prefix_cache.pinned_blocks
        assert stats.num_free_blocks + pinned == stats.num_blocks, \
            f"{stats.num_blocks - stats.num_free_blocks - pinned} blocks not free"
        return
    core = getattr(engine, "core", engine)
    pool, pins = core.kv.pool, core.kv.pins
    assert not core.requests, f"{len(core.requests)} requests still in the engine"
    referenced = [b.block_id for b in pool.blocks if b.ref_cnt != (1 if pins.is_pinned(b) else 0)]
    assert not referenced, f"blocks still referenced: {referenced[:10]}"
    assert pool.num_free_blocks + pins.num_blocks == len(pool.blocks), "free queue lost blocks"
    assert not core.kv.block_tables, f"block tables left: {list(core.kv.block_tables)[:10]}"
