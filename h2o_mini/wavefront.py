"""Reading a text through an evicting cache with the per-token loops of several layers run as one.

In stream mode every layer runs a short loop per token (`prompt.stream`: evict, insert, attend, update) whose
small operations cost far more than their arithmetic: on a CPU ~2-5 us each, on a GPU one kernel launch each.
Within one layer and chunk that loop is sequential, but nothing ties one layer's loop to another's except
the data flowing up the stack. Chunk c reaches layer l just after chunk c-1 left it, so chunk c at layer l,
chunk c-1 at layer l+1, chunk c-2 at layer l+2, ... (an anti-diagonal of the chunk x layer grid) are ready at
the same time, and their loops run as the rows of one batch (`prompt.stream_many`). A text of n chunks
through L layers then takes n + L - 1 loops over a chunk instead of n x L.

How, without changing the model's code: each chunk's forward pass runs in a thread of its own, and the threads
take turns, exactly one running at a time (so nothing runs concurrently and every operation is the one the
sequential pass runs). A pass runs until its next attention (the cache hands the request here,
`LayerCache.rendezvous`); when every pass in flight has asked, the requests run as one loop, and each pass
goes on with its own output. Each row's arithmetic is its own (the loop's operations run along the slot
axis of each row), so the logits equal those of reading the chunks one after another.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from . import prompt


class _Stop(Exception):
    """Ends a pass whose reader has stopped (an error elsewhere, or the caller stopped iterating)."""


class _Pass(threading.Thread):
    """One chunk's forward pass, run a turn at a time."""

    def __init__(self, turns: "_Turns", forward, idx, pos, cache):
        super().__init__(daemon=True)
        self.turns, self.forward, self.idx, self.pos, self.cache = turns, forward, idx, pos, cache
        self.request = self.result = self.out = self.error = None
        self.done = False

    def run(self):
        try:
            self.turns.wait_for(self)
            with torch.inference_mode():
                self.out = self.forward(self.idx, self.pos, self.cache)
        except _Stop:
            pass
        except BaseException as e:  # handed to the reader, which raises it
            self.error = e
        finally:
            self.turns.finish(self)


class _Turns:
    """Which pass may run now (None: the reader)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.running: _Pass | None = None
        self.stopped = False

    def wait_for(self, p: _Pass) -> None:  # in p's thread
        with self.cv:
            while self.running is not p and not self.stopped:
                self.cv.wait()
        if self.stopped:
            raise _Stop

    def resume(self, p: _Pass) -> None:
        """The reader lets `p` run until it asks for attention or ends."""
        with self.cv:
            self.running = p
            self.cv.notify_all()
            while self.running is p:
                self.cv.wait()
        if p.error is not None:
            raise p.error

    def attend(self, layer, q, k, v, pos) -> torch.Tensor:
        """`LayerCache.rendezvous`: the running pass's attention, computed with the others' at the next batch."""
        me = self.running
        me.request = (layer, q, k, v, pos)
        with self.cv:
            self.running = None
            self.cv.notify_all()
        self.wait_for(me)
        out, me.result = me.result, None
        return out

    def finish(self, p: _Pass) -> None:
        with self.cv:
            p.done = True
            if self.running is p:
                self.running = None
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()


def read(forward, cache, idx: torch.Tensor, pos: torch.Tensor, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, forward(idx[:, s:s+chunk], pos[:, s:s+chunk], cache)) for each chunk of (idx, pos) (B, T), in
    order: `forward` is the model (logits) or `model.hidden`; `cache` reads prompts in stream mode. The loops of
    every chunk in flight run batched."""
    turns = _Turns()
    starts = list(range(0, idx.shape[1], chunk))
    passes: list[_Pass] = []
    for layer in cache.layers:
        layer.rendezvous = turns.attend
    try:
        emitted = 0
        while emitted < len(starts):
            if len(passes) < len(starts):  # chunk c starts once chunk c-1 has left layer 0
                s = starts[len(passes)]
                passes.append(_Pass(turns, forward, idx[:, s:s + chunk], pos[:, s:s + chunk], cache))
                passes[-1].start()
            for p in passes[emitted:]:
                if not p.done:
                    turns.resume(p)
            asking = [p for p in passes[emitted:] if p.request is not None]
            groups: dict[tuple, list[_Pass]] = {}  # one loop per shape (the last chunk may be shorter)
            for p in asking:
                layer, q = p.request[0], p.request[1]
                groups.setdefault((tuple(q.shape), tuple(layer.pos.shape)), []).append(p)
            for group in groups.values():
                outs = prompt.stream_many([p.request for p in group])
                for p, out in zip(group, outs):
                    p.request, p.result = None, out
            while emitted < len(passes) and passes[emitted].done:
                yield starts[emitted], passes[emitted].out
                passes[emitted].out = None
                emitted += 1
    finally:
        turns.stop()
        for layer in cache.layers:
            layer.rendezvous = None
