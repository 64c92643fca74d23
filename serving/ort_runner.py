"""An exported decoder in an ONNX Runtime session: the cache (and scale) as ORT-owned tensors bound to every
step with IOBinding (the ops write them in place, no copy), the step's index inputs bound from host
memory, and StreamingLLM's key shift as a second small graph of KeyCacheRotaryShift nodes on the same
cache."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ..ort_ops.graph_rules import load_model
from ..ort_ops.session import make_session
from ..reference.layout import cache_shape
from ..spec import rotary_schema
from ..spec.model import DEFAULT_OPSET, IR_VERSION
from .decoder_io import OUTPUT_NAME
from .greedy_steps import GreedySteps
from .model_check import rotary_table_rows
from .model_info import ModelInfo
from .next_decode_graph import GREEDY_TOKENS, with_greedy_tokens, with_next_decode
from .sampler_graph import COMPLETE, LOGITS, PARAMETER_INPUTS, SORT_WIDTH, TOKENS, host_drawn, sampler_model
from .sampling import greedy_tokens

ELEMENT_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
BYTES = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.INT8: 1}


def default_providers() -> list:
    """The CUDA EP when this ONNX Runtime has it (``onnxruntime-gpu``), else the CPU EP."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def exact_float32(providers: list, compute_dtype: str) -> list:
    """``providers`` with the CUDA EP, where it is named without options and the model computes in float32, told not
    to use TF32: ONNX Runtime's CUDA EP multiplies float32 matrices in TF32 by default (10-bit mantissas), and a
    float32 model's tokens would then drift from the float32 model's own (as torch's default, which keeps float32
    products in float32). Options a caller gives are kept as given."""
    if compute_dtype != "float32":
        return list(providers)
    return [("CUDAExecutionProvider", {"use_tf32": "0"}) if p == "CUDAExecutionProvider" else p for p in providers]


def provider_device(providers: list) -> tuple:
    """(``"cuda"`` or ``"cpu"``, device id) where the first provider (a name, or ``(name, options)``) keeps
    its tensors."""
    first = providers[0]
    name, options = (first, {}) if isinstance(first, str) else (first[0], dict(first[1]))
    if name == "CUDAExecutionProvider":
        return "cuda", int(options.get("device_id", 0))
    if name != "CPUExecutionProvider":
        raise ValueError(f"the engine binds its cache on the CPU or CUDA execution provider, got {name!r} first")
    return "cpu", 0


def device_providers(providers: list) -> list:
    """``providers`` without the CPU EP: those of a session whose every node must run on the device (ONNX Runtime
    refuses ``session.disable_cpu_ep_fallback`` with the CPU EP named, as :func:`default_providers` names it)."""
    return [p for p in providers if (p if isinstance(p, str) else p[0]) != "CPUExecutionProvider"]


def _zeroed(shape: tuple, element_type: int, device: tuple) -> ort.OrtValue:
    """An ORT-allocated tensor on ``device`` (kind, id), zero-filled where numpy can supply the bytes."""
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), element_type, *device)
    device = device[0]
    count = int(np.prod(shape))
    nbytes = (count + 1) // 2 if element_type == TensorProto.INT4 else count * BYTES[element_type]
    if device == "cpu":
        ctypes.memset(value.data_ptr(), 0, nbytes)
    elif element_type != TensorProto.INT4:  # a host buffer of the same bytes, copied once to the device
        value.update_inplace(np.zeros(nbytes, np.uint8).view(_host_dtype(element_type)).reshape(shape))
    # A device int4 cache stays as allocated (numpy has no int4 to copy from): no slot is gathered before
    # a step stored it, so its first contents are never read.
    return value


def _check_fits(num_pages: int, shape: tuple, element_type: int, info: ModelInfo, device: tuple) -> None:
    """``ValueError`` before allocating when the cache (and scale) of ``num_pages`` pages would not fit this
    machine's memory (host caches; a device's memory is the device's to refuse)."""
    count = int(np.prod(shape, dtype=object))
    nbytes = (count + 1) // 2 if element_type == TensorProto.INT4 else count * BYTES[element_type]
    if info.quant_bit:
        nbytes += count // info.quant_group * BYTES[ELEMENT_TYPES[info.scale_dtype]]
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if device[0] == "cpu" and nbytes > memory:
        raise ValueError(f"num_pages={num_pages} pages of {info.page_size} make a cache of {nbytes / 2**30:.1f} GiB, "
                         f"more than this machine's {memory / 2**30:.1f} GiB of memory")


def _host_dtype(element_type: int):
    return {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: np.uint16,
            TensorProto.INT8: np.int8}[element_type]


class ModelRunner:
    """Runs steps of the exported decoder at ``model_path`` over a cache of ``num_pages`` pages. ``step_tokens``: the
    most tokens a step will feed, checked against :attr:`step_token_limit` before anything is allocated."""

    def __init__(self, model_path, num_pages: int, providers=None, intra_op_num_threads: int = 0,
                 step_tokens: int = None):
        model = load_model(model_path)
        self.info = ModelInfo.of_model(model)
        #: The most tokens one step may feed (the rows of the graph's rotary tables: ONNX Runtime's RotaryEmbedding
        #: refuses a longer sequence), or None where the graph sets no such limit.
        self.step_token_limit = rotary_table_rows(model)
        if step_tokens is not None and self.step_token_limit is not None and step_tokens > self.step_token_limit:
            raise ValueError(f"max_batch_tokens={step_tokens} is more than the {self.step_token_limit} positions the "
                             "model's rotary tables hold, and ONNX Runtime's RotaryEmbedding refuses a step of more "
                             f"tokens than that: give at most {self.step_token_limit}")
        self.providers = exact_float32(list(providers) if providers is not None else default_providers(),
                                       self.info.cache_dtype)
        self.device = provider_device(self.providers)
        if self.device[0] != "cpu":
            from ..capi import c_api

            if not c_api.has_cuda():
                # ONNX Runtime would run the cache ops on the CPU over a copy of the device cache, and their in-place
                # writes would never reach the cache the next step reads.
                raise ValueError(f"{self.providers[0]} needs a CUDA build of kvcache-op (this library has no CUDA "
                                 f"kernels: reinstall where nvcc is found, KVCACHE_OP_CUDA=1), or serve on the CPU EP")
        # Every op of an exported decoder has a CUDA kernel (the cache ops and both attention ops here, the rest ONNX
        # Runtime's own), so under the CUDA EP the cache stays on the device and is written in place.
        # On the CPU EP the graph also chooses greedy tokens and the next decode step's inputs (:mod:`.next_decode_graph`),
        # for runs of decode steps with no host work between them (:meth:`greedy_steps`). A device session's graph
        # chooses greedy tokens only (its nodes, Cast and ArgMax, have CUDA kernels): a greedy step's tokens cross the
        # bus, not its logits (:meth:`run_greedy`).
        extended = with_next_decode(model) if self.device[0] == "cpu" else with_greedy_tokens(model)
        self.session = make_session(extended, self.providers, intra_op_num_threads, config={
            # the model is read from memory: its external data (if any) lies beside the file
            "session.model_external_initializers_file_folder_path": os.path.dirname(os.path.abspath(model_path))})
        self.session_inputs = [i.name for i in self.session.get_inputs()]
        i = self.info
        self.cache_type = (TensorProto.INT8 if i.quant_bit == 8 else TensorProto.INT4 if i.quant_bit == 4
                           else ELEMENT_TYPES[i.cache_dtype])
        num_slots = num_pages * i.page_size
        shape = cache_shape(i.cache_layout, i.num_layers, num_slots, i.num_kv_heads, i.head_dim)
        _check_fits(num_pages, shape, self.cache_type, i, self.device)
        self.cache = _zeroed(shape, self.cache_type, self.device)
        self.scale = None
        if i.quant_bit:
            scale_shape = cache_shape(i.cache_layout, i.num_layers, num_slots, i.num_kv_heads,
                                      i.head_dim // i.quant_group)
            self.scale = _zeroed(scale_shape, ELEMENT_TYPES[i.scale_dtype], self.device)
        self.cache_bytes = sum(int(np.prod(v.shape())) * (BYTES.get(self.cache_type, 0.5) if v is self.cache
                                                          else BYTES[ELEMENT_TYPES[i.scale_dtype]])
                               for v in (self.cache, self.scale) if v is not None)
        self._shift_session = None
        self._greedy_steps = None
        self._sampler = None  # the sampling graph's session (:meth:`run_sampled`), made on first use
        self._intra_op_num_threads = intra_op_num_threads
        # One binding for every step: the cache (and scale) bound once. On the CPU EP each index input is bound to a
        # host buffer this runner owns, refilled in place while its shape holds (rebound when it changes, e.g. a
        # page-table column more), and the logits to a host buffer per batch size: binding afresh each step cost
        # more than a tenth of a small model's decode step. A device session copies an input that a device node
        # reads when it is bound (ONNX Runtime's IOBinding::BindInput), so a refill would never reach it: there
        # every input is bound afresh each step.
        self._binding = self.session.io_binding()
        self._binding.bind_ortvalue_input("cache", self.cache)
        if "scale" in self.session_inputs:
            self._binding.bind_ortvalue_input("scale", self.scale)
        self._inputs = {}  # name -> the host buffer bound to it
        self._logits = None  # the host buffer bound to the logits
        self._tokens = None  # the host buffer bound to the greedy tokens (CPU EP)
        #: Rows of logits copied from the device to the host (none on the CPU EP, where the graph makes them).
        self.device_logit_rows = 0
        #: Rows of :meth:`run_greedy` whose token the host chose, the graph's being outside the vocabulary.
        self.host_chosen_rows = 0
        #: Rows of :meth:`run_sampled` whose token the host drew, their nucleus lying past the tokens the graph sorted.
        self.host_sampled_rows = 0
        output = self.session.get_outputs()[0]
        self._logits_type = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16,
                             "tensor(bfloat16)": TensorProto.BFLOAT16}.get(output.type)  # None: no graph sampling
        #: Whether the engine should draw sampled tokens with the sampling graph (:meth:`run_sampled`) rather than on
        #: the host: on a device, where the graph keeps the logits there. The host sampler (:mod:`.sampling`) defines
        #: the draws; the graph's agree with it to float64 rounding.
        self.graph_sampling = self.device[0] != "cpu" and self._logits_type is not None
        # The logits' host buffer's type; None: they stay in a tensor ONNX Runtime allocates, read each step (numpy has
        # no bfloat16, and a device session's copy into a bound host buffer has not been run on a GPU yet).
        self._logits_dtype = (None if self.device[0] != "cpu" else
                              {"tensor(float)": np.float32, "tensor(float16)": np.float16}.get(output.type))

    def run(self, feeds: dict, changed=None) -> np.ndarray:
        """One step: ``feeds`` from :func:`~kvcache_op.serving.step_feeds`; returns the logits ``[B, vocab]``
        (host, the graph's float type), in a buffer the next step (``run`` or :meth:`run_greedy`) may overwrite (copy
        what must outlive the step). The cache is updated in place. One call at a time: the runner's buffers serve
        every step. ``changed``: the names of the only inputs that differ from the previous call's (which fed the
        same shapes): on the CPU EP the others are not copied again."""
        binding, rows = self._bind_inputs(feeds, changed), len(feeds["seqstarts"]) - 1
        if self.device[0] == "cpu":
            return self._run_for_host_logits(binding, rows)()
        logits = self._run_on_device(binding, ("cpu", 0), tokens=False)[0]
        self.device_logit_rows += rows
        return logits.numpy()

    def run_greedy(self, feeds: dict, changed=None) -> np.ndarray:
        """One step as :meth:`run`, returning each row's greedy token instead of its logits: int64 ``[B]``, the first
        of equal maxima (numpy's ``argmax`` of the logits; of a row holding NaN, whichever ONNX Runtime's ArgMax
        gives: on the CPU it passes over NaNs, where numpy's takes the first), in a buffer the next step may
        overwrite. The graph chooses them, so on a device only the tokens cross the bus. A row whose token from the
        graph is not in the vocabulary (ONNX Runtime's CUDA ArgMax gives INT32_MAX for a row of -inf, which the device
        graph's clip avoids) is chosen on the host from its logits (:attr:`host_chosen_rows` counts them)."""
        binding, rows = self._bind_inputs(feeds, changed), len(feeds["seqstarts"]) - 1
        logits = self._run_leaving_logits(binding, rows)
        tokens = self._tokens if self.device[0] == "cpu" else np.array(binding.get_outputs()[1].numpy())  # owned
        return self._in_vocabulary(tokens, logits)

    def run_sampled(self, feeds: dict, sampling: dict, changed=None) -> np.ndarray:
        """One step as :meth:`run`, returning each row's token as the sampling graph draws it
        (:mod:`.sampler_graph`) from ``sampling`` (:func:`~.sampler_graph.sampler_feeds`: per row the temperature,
        top-k, top-p, min-p and a uniform) instead of its logits: int64 ``[B]``, owned. The graph runs where the
        logits are, so on a device only the tokens cross the bus; a row the graph leaves incomplete (its nucleus past
        the tokens it sorted) is drawn on the host from its logits and the same uniform (:attr:`host_sampled_rows`
        counts them), and a greedy row whose token is not in the vocabulary is chosen there too, as in
        :meth:`run_greedy`."""
        binding, rows = self._bind_inputs(feeds, changed), len(feeds["seqstarts"]) - 1
        logits = self._run_leaving_logits(binding, rows)
        sampler = self._sampler_binding()
        sampler.bind_ortvalue_input(LOGITS, binding.get_outputs()[0])  # the step's logits, where they were made
        for name in PARAMETER_INPUTS:
            sampler.bind_cpu_input(name, sampling[name])
        # numpy has no bfloat16, so the host could not read such a row to draw it: bfloat16 logits are sorted whole,
        # which leaves no row incomplete
        whole = self._logits_type == TensorProto.BFLOAT16 and sampling[SORT_WIDTH][0] > 1
        sampler.bind_cpu_input(SORT_WIDTH, np.array([self.info.vocab_size]) if whole else sampling[SORT_WIDTH])
        sampler.bind_output(TOKENS, "cpu")
        sampler.bind_output(COMPLETE, "cpu")
        self._sampler.run_with_iobinding(sampler)
        tokens, complete = (np.array(value.numpy()) for value in sampler.get_outputs()[:2])  # owned
        incomplete = np.flatnonzero(~complete)
        if incomplete.size:  # a nucleus past the sorted tokens: those rows' logits cross, and the host draws
            tokens[incomplete] = host_drawn(logits()[incomplete], sampling, incomplete)
            self.host_sampled_rows += int(incomplete.size)
        return self._in_vocabulary(tokens, logits)

    def _sampler_binding(self) -> ort.IOBinding:
        """A new binding of the sampling graph's session (made on first use, beside the runner's)."""
        if self._sampler is None:
            self._sampler = self._session_beside(sampler_model(self._logits_type))
        return self._sampler.io_binding()

    def _session_beside(self, model: onnx.ModelProto) -> ort.InferenceSession:
        """A session of ``model`` where this runner's tensors are: on a device EP with every node on the device (a
        node falling back to the CPU would read a copy of what it should read or write in place)."""
        if self.device[0] == "cpu":
            return make_session(model, self.providers, self._intra_op_num_threads)
        return make_session(model, device_providers(self.providers), self._intra_op_num_threads,
                            disable_cpu_fallback=True)

    def _run_leaving_logits(self, binding, rows: int):
        """Runs a step whose logits stay where the graph makes them (the binding's first output: on a device, there;
        on the CPU EP, the host buffer) and whose greedy tokens come to the host (its second); returns a function
        giving the logits on the host (on a device a copy made on the first call, counted in
        :attr:`device_logit_rows`)."""
        if self.device[0] == "cpu":
            return self._run_for_host_logits(binding, rows)
        self._run_on_device(binding, self.device, tokens=True)
        copied = []

        def logits():
            if not copied:  # once a step, however many of its rows the host chooses
                self.device_logit_rows += rows
                copied.append(binding.copy_outputs_to_cpu()[0])
            return copied[0]
        return logits

    def _run_on_device(self, binding, logits_to: tuple, tokens: bool) -> list:
        """Runs a device step with its outputs bound afresh (a step of the other kind may have left its own): the
        logits to ``logits_to`` (kind, id), the greedy tokens to the host where ``tokens``; returns the outputs in
        that order."""
        binding.clear_binding_outputs()
        binding.bind_output(OUTPUT_NAME, *logits_to)
        if tokens:
            binding.bind_output(GREEDY_TOKENS, "cpu")
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()

    def _bind_inputs(self, feeds: dict, changed) -> ort.IOBinding:
        """The runner's binding with ``feeds``' index inputs bound (see :meth:`run`)."""
        binding, refill = self._binding, self.device[0] == "cpu"
        names = self.session_inputs if changed is None or not refill else [n for n in self.session_inputs if n in changed]
        for name in names:
            if name == "cache" or name == "scale":
                continue
            value, bound = feeds[name], self._inputs.get(name)
            if not refill:
                binding.bind_cpu_input(name, value)  # copied to the device now, as the step's own array
            elif bound is not None and bound.shape == value.shape:
                np.copyto(bound, value)
            else:
                bound = np.array(value, np.int64, order="C")  # owned: nobody changes it
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(bound))
                self._inputs[name] = bound  # after the bind: the buffer it replaces stays alive until then
        return binding

    def _run_for_host_logits(self, binding, rows: int):
        """Runs a CPU EP step with the logits bound to the host (bound first, so they are the binding's first
        output) and the greedy tokens to :attr:`_tokens` (the graph makes them whether read or not, and a buffer
        left bound must keep the step's shape); returns a function giving the logits."""
        if self._logits_dtype is None:
            binding.bind_output(OUTPUT_NAME, "cpu")
        elif self._logits is None or len(self._logits) != rows:
            self._logits = np.empty((rows, self.info.vocab_size), self._logits_dtype)  # its width checked vs the graph
            binding.bind_ortvalue_output(OUTPUT_NAME, ort.OrtValue.ortvalue_from_numpy(self._logits))
        if self._tokens is None or len(self._tokens) != rows:
            self._tokens = np.empty(rows, np.int64)
            binding.bind_ortvalue_output(GREEDY_TOKENS, ort.OrtValue.ortvalue_from_numpy(self._tokens))
        self.session.run_with_iobinding(binding)
        if self._logits_dtype is None:
            return lambda: binding.get_outputs()[0].numpy()
        return lambda: self._logits

    def _in_vocabulary(self, tokens: np.ndarray, logits) -> np.ndarray:
        """``tokens`` with each one outside the vocabulary replaced by the host's argmax of its row of ``logits()``."""
        bad = np.flatnonzero((tokens < 0) | (tokens >= self.info.vocab_size))
        if bad.size:
            tokens[bad] = greedy_tokens(logits()[bad])
            self.host_chosen_rows += int(bad.size)
        return tokens

    def greedy_steps(self):
        """A :class:`~.greedy_steps.GreedySteps` over this runner's session and cache (one, kept), or None on a device
        EP (its graph has no next decode step). Steps run through it and through :meth:`run` must not overlap."""
        if self.device[0] != "cpu":
            return None
        if self._greedy_steps is None:
            self._greedy_steps = GreedySteps(self.session, self.cache, self.scale,
                                             self._logits_dtype, self.info.vocab_size)
        return self._greedy_steps

    def shift_keys(self, slots: np.ndarray, deltas: np.ndarray) -> None:
        """Rotates the keys stored in ``slots`` by ``deltas`` positions in every layer (StreamingLLM's
        shift), with the model's own rotary frequencies: ``angle = delta * inv_freq`` in float64."""
        if self._shift_session is None:
            self._shift_session = self._session_beside(self._shift_model())
        angles = np.asarray(deltas, np.float64)[:, None] * np.asarray(self.info.inv_freq, np.float64)[None, :]
        binding = self._shift_session.io_binding()
        binding.bind_ortvalue_input("cache", self.cache)
        if self.scale is not None:
            binding.bind_ortvalue_input("scale", self.scale)
        binding.bind_cpu_input("slots", np.ascontiguousarray(slots, np.int64))
        binding.bind_cpu_input("cos", np.cos(angles).astype(np.float32))
        binding.bind_cpu_input("sin", np.sin(angles).astype(np.float32))
        binding.bind_output("slots_out", "cpu")
        self._shift_session.run_with_iobinding(binding)

    def _shift_model(self) -> onnx.ModelProto:
        """KeyCacheRotaryShift on every layer, chained through ``slots_out`` so the writes are ordered."""
        i = self.info
        cache_dims = ["d0", "d1", "d2", "d3", "d4"]
        inputs = [helper.make_tensor_value_info("cache", self.cache_type, cache_dims)]
        names = ["cache"]
        if self.scale is not None:
            inputs.append(helper.make_tensor_value_info("scale", ELEMENT_TYPES[i.scale_dtype], cache_dims[:4] + ["groups"]))
            names.append("scale")
        else:
            names.append("")
        inputs += [helper.make_tensor_value_info("slots", TensorProto.INT64, ["n"]),
                   helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["n", "r"]),
                   helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["n", "r"])]
        nodes, slots = [], "slots"
        for layer in range(i.num_layers):
            out = "slots_out" if layer == i.num_layers - 1 else f"slots_after_layer_{layer}"
            nodes.append(helper.make_node(
                rotary_schema.OP_TYPE, [*names, slots, "cos", "sin"], [out], domain=rotary_schema.DOMAIN,
                num_layer=i.num_layers, layer_idx=layer, cache_layout=i.cache_layout, quant_bit=i.quant_bit,
                quant_group=i.quant_group, rotary_dim=2 * len(i.inv_freq)))  # partial rotary: the leading dims
            slots = out
        graph = helper.make_graph(nodes, "key_shift", inputs,
                                  [helper.make_tensor_value_info("slots_out", TensorProto.INT64, ["n"])])
        return helper.make_model(graph, ir_version=IR_VERSION, producer_name="kvcache-op",
                                 opset_imports=[helper.make_opsetid("", DEFAULT_OPSET),
                                                helper.make_opsetid(rotary_schema.DOMAIN, 1)])
