"""Phases of work shared by the threads of one parallel region, for a compiled step that launches its threads
once (decode_step_cpu.py) rather than once per matmul.

Each phase is cut into chunks; a thread claims the phase's next chunk with an atomic add, works on it, counts it
done, and claims again until none is left; it then waits, spinning, until every chunk of the phase is done, and
goes on to the next phase. The threads walk the same phases in the same order, each counting them itself, so
phase p has the same counters in every thread. A thread only ever waits for chunks that a running thread has
claimed, so the region cannot deadlock whatever the threading layer does: if it ran the threads' iterations one
after the other, the first would claim every chunk and the others would find none left. A thread that is held up
(another process on its core) delays the others only by the chunk it holds.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below

# int64 counters a phase takes: its claims at 0, its completions at HALF, each on a cache line of its own so that
# a thread's claim does not take the line that the waiting threads read
STRIDE = 16
HALF = STRIDE // 2
# spins (each a pause) before a waiting thread also yields its core at each spin: a thread that is still working
# may be waiting for that core (two compute threads and a server on two cores)
SPINS_BEFORE_YIELD = 20_000
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@njit(nogil=True, cache=kernel_cache.CACHE)
def new_counters(phases):
    """Zeroed counters for `phases` phases."""
    return np.zeros((phases, STRIDE), np.int64)


def _counter(context, builder, signature, args) -> ir.Value:
    """Pointer to counters[phase, offset] for an intrinsic called as (counters, phase, offset)."""
    counters = context.make_array(signature.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, signature.args[0], counters, [args[1], args[2]])


@intrinsic
def _fetch_add(typingctx, ary, phase, offset):
    """counters[phase, offset] += 1, atomically; returns the value before."""
    def codegen(context, builder, signature, args):
        pointer = _counter(context, builder, signature, args)
        return builder.atomic_rmw("add", pointer, ir.Constant(ir.IntType(64), 1), "seq_cst")
    return types.int64(ary, types.intp, types.intp), codegen


@intrinsic
def _load(typingctx, ary, phase, offset):
    """counters[phase, offset], read afresh every time (an acquire load: what the thread that counted wrote
    before is seen after it)."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_counter(context, builder, signature, args), "acquire", 8)
    return types.int64(ary, types.intp, types.intp), codegen


@intrinsic
def _pause(typingctx):
    """A spin-wait hint (x86 `pause`: the core slows the loop and frees resources for its sibling)."""
    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _yield(typingctx):
    """sched_yield(2): the core to another runnable thread, if any."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(nogil=True, cache=kernel_cache.CACHE, inline="always")
def claim(ary, phase):
    """The index of the next chunk of `phase` for this thread (>= the phase's chunk count: none left)."""
    return _fetch_add(ary, phase, 0)


@njit(nogil=True, cache=kernel_cache.CACHE, inline="always")
def finish(ary, phase):
    """Counts one chunk of `phase` done (after the chunk's writes)."""
    _fetch_add(ary, phase, HALF)


@njit(nogil=True, cache=kernel_cache.CACHE)
def wait(ary, phase, chunks):
    """Returns when all `chunks` chunks of `phase` are done."""
    spins = 0
    while _load(ary, phase, HALF) < chunks:
        _pause()
        spins += 1
        if spins > SPINS_BEFORE_YIELD:
            _yield()


# not cached itself: a caller compiled in a process that took this generator from numba's cache finds no lowering
# for it (KeyError in numba's get_generator_impl); its cached callers hold its code all the same
@njit(nogil=True)
def claimed(ary, phase, chunks):
    """This thread's chunks of `phase`, for a loop's body to work on: each is counted done when the body asks for
    the next, and the loop ends when all `chunks` chunks are done, whoever claimed them. (A generator, where a
    function taken as an argument would be an address that numba's cache cannot keep.)"""
    c = claim(ary, phase)
    while c < chunks:
        yield c
        finish(ary, phase)
        c = claim(ary, phase)
    wait(ary, phase, chunks)
