"""Runs of greedy decode steps with nothing on the host between them but the run itself: the session's graph
chooses each row's token and computes the next step's changing index inputs (:mod:`.next_decode_graph`), and
two IOBindings over two sets of host buffers alternate, each step's outputs being the next step's inputs. A run
may begin with a step of several tokens a sequence (prompts' last chunks) through a third binding, whose chosen
tokens are written straight into the first decode step's ``input_ids``.

Why: code that runs right after an ONNX Runtime step runs cold (measured on a small model: an argmax over 4,096
logits takes 16 us just after a step, 3 us the second time), so a decode loop's host share follows the number of
distinct operations between its steps. Here there is one, the run, and the host reads the tokens.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from .decoder_io import OUTPUT_NAME
from .next_decode_graph import NEXT_DECODE_INPUTS, NEXT_PREFIX


class GreedySteps:
    """Two IOBindings (and one for a leading step) of ``session`` (a graph from
    :func:`~.next_decode_graph.with_next_decode`) over ``cache`` (and ``scale``), kept from run to run: buffers are
    refilled in place while their shapes hold and rebound when they change. One run at a time (the runner's caller
    serializes steps)."""

    def __init__(self, session: ort.InferenceSession, cache: ort.OrtValue, scale, logits_dtype, vocab_size: int):
        """``logits_dtype``: the numpy type of the graph's logits, None where numpy has none (bfloat16)."""
        self.session = session
        self.input_names = [i.name for i in session.get_inputs() if i.name not in ("cache", "scale")]
        # the two decode bindings, and a third for a step of several tokens before the decode steps (prompts' last
        # chunks: a leading step)
        self.bindings = [session.io_binding(), session.io_binding(), session.io_binding()]
        for binding in self.bindings:
            binding.bind_ortvalue_input("cache", cache)
            if scale is not None:
                binding.bind_ortvalue_input("scale", scale)
        self._logits_dtype, self._vocab = logits_dtype, vocab_size
        self._buffers = [{}, {}, {}]  # per binding: input name -> (the host buffer bound to it, its OrtValue)
        self._logits = None
        self._turn = 0
        self._lead = False  # the next step is the leading one
        self._leading_target = None  # the OrtValue the leading step's chosen tokens are bound to

    def start(self, feeds: dict, leading: dict = None) -> None:
        """Binds ``feeds``, a decode step's (:func:`~.step_feeds.step_feeds`; the page tables must hold the pages of
        every step this run takes), as the first step's inputs. ``leading``: the feeds of a step to run before it
        (prompts' last chunks, and decodes), whose chosen tokens become that decode step's ``input_ids``; ``feeds``
        are then the decode step that the leading step ends as (its positions, each sequence's last)."""
        self._turn = 0
        first, second, _ = self._buffers
        for name in self.input_names:
            value = feeds[name]
            replaced = self._fill(0, name, value)
            if name in NEXT_DECODE_INPUTS:  # the second binding's input is the first's output (written by it)
                if self._fill(1, name, value, copy=False) or replaced:
                    for binding, buffers in ((self.bindings[0], second), (self.bindings[1], first)):
                        binding.bind_ortvalue_output(NEXT_PREFIX + name, buffers[name][1])
            elif first[name] is not second.get(name):  # the same in every step: one buffer bound to both
                second[name] = first[name]
                self.bindings[1].bind_ortvalue_input(name, first[name][1])
        rows = len(feeds["seqstarts"]) - 1
        if self._logits_dtype is None:  # bfloat16 (numpy has none): ONNX Runtime allocates them each step
            if self._logits is None:
                self._logits = ()
                for binding in self.bindings:
                    binding.bind_output(OUTPUT_NAME, "cpu")
        elif self._logits is None or len(self._logits) != rows:  # never read: where ONNX Runtime puts the logits
            self._logits = np.empty((rows, self._vocab), self._logits_dtype)
            value = ort.OrtValue.ortvalue_from_numpy(self._logits)
            for binding in self.bindings:
                binding.bind_ortvalue_output(OUTPUT_NAME, value)
        self._lead = leading is not None
        if self._lead:
            self._bind_leading(leading)

    def _bind_leading(self, feeds: dict) -> None:
        """Binds the leading step (buffers kept as the decode steps' are; its logits go where theirs go, one row per
        sequence there too): its inputs, and its chosen tokens into the first decode step's ``input_ids``."""
        for name in self.input_names:
            self._fill(2, name, feeds[name])
        target = self._buffers[0]["input_ids"][1]
        if self._leading_target is not target:
            self.bindings[2].bind_ortvalue_output(NEXT_PREFIX + "input_ids", target)
            self._leading_target = target

    def _fill(self, which: int, name: str, value, copy: bool = True) -> bool:
        """Copies ``value`` into binding ``which``'s buffer for input ``name`` (``copy`` False: only a buffer of its
        shape is needed); binds a new buffer (and returns True) when there was none of its shape."""
        buffers = self._buffers[which]
        bound = buffers.get(name)
        if bound is not None and bound[0].shape == np.shape(value):
            if copy:
                np.copyto(bound[0], value)
            return False
        array = np.array(value, np.int64, order="C")  # owned: nobody else changes it
        buffers[name] = array, ort.OrtValue.ortvalue_from_numpy(array)
        self.bindings[which].bind_ortvalue_input(name, buffers[name][1])
        return True

    def step(self) -> np.ndarray:
        """Runs one step; returns its chosen tokens (int64, one per row), a view the step after next overwrites."""
        if self._lead:
            self.session.run_with_iobinding(self.bindings[2])
            self._lead = False
            return self._buffers[0]["input_ids"][0]
        turn = self._turn
        self.session.run_with_iobinding(self.bindings[turn])
        self._turn = 1 - turn
        return self._buffers[1 - turn]["input_ids"][0]
