"""ONNX Runtime as a conformance backend: any custom-op library, any execution provider, IOBinding throughout.

Every input is bound as an ``OrtValue`` on the provider's device (host memory for the CPU EP, where the
OrtValue wraps the caller's array itself); after the run the in-place inputs are copied back from the
device, so writes made on a device are observed exactly as the op made them (a numpy feed would be copied
to the device and the writes lost). Outputs are bound to host memory. With a provider other than the CPU
EP, the session refuses to fall back to the CPU silently.
"""

import pathlib

import numpy as np
import onnxruntime as ort
from onnx import helper

from ..ort_ops.graph_rules import onnxruntime_release, refuse_crashing_nodes
from ..ort_ops.session import KeptSessions
from .outcome import OUTPUTS, Outcome, in_place_after
from .adapters import ALL_OPS, BackendLoadError, error_text, graph_feeds

#: The OrtValue device type of each execution provider whose memory is not the host's.
DEVICE_OF_PROVIDER = {"CUDAExecutionProvider": "cuda", "DmlExecutionProvider": "dml", "CANNExecutionProvider": "cann"}
_MAX_SESSIONS = 8


class OrtBackend:
    """Runs each call's one-node model in an ``InferenceSession`` with ``library`` registered (the project's
    library by default) on ``provider`` (default CPU) with ``provider_options``; ``device`` is where inputs
    are bound (default: the provider's device, ``cpu`` for providers not in :data:`DEVICE_OF_PROVIDER`).
    :class:`BackendLoadError` (one line) when the library cannot be loaded, the provider is unknown or, for a device,
    onnxruntime is older than 1.26 (which copies to and from devices as the kit does)."""

    #: The ops the library registers in ONNX Runtime: all of them.
    ops = ALL_OPS

    def __init__(self, ort_library=None, provider=None, provider_options=None, device=None):
        from ..ort_ops import library_path

        self.library = str(ort_library) if ort_library else library_path()
        if not pathlib.Path(self.library).is_file():
            raise BackendLoadError(f"--ort-library {self.library}: no such file")
        self.provider = provider or "CPUExecutionProvider"
        if self.provider not in ort.get_available_providers():
            raise BackendLoadError(f"--provider {self.provider} is not available in this onnxruntime "
                                   f"(available: {', '.join(ort.get_available_providers())})")
        self.provider_options = {str(k): str(v) for k, v in (provider_options or {}).items()}
        self.device = device or DEVICE_OF_PROVIDER.get(self.provider, "cpu")
        self.device_id = int(self.provider_options.get("device_id", 0))
        # Inputs go to separate OrtValues on the device, in-place ones copied back after the run (forced on the
        # CPU, this is how the device path is tested without a device).
        self.copy_inputs = self.device != "cpu"
        if self.copy_inputs and (onnxruntime_release() or (1, 26)) < (1, 26):
            raise BackendLoadError(f"onnxruntime {ort.__version__}: its OrtValue.update_inplace takes no OrtValue, "
                                   "which inputs on a device are copied with (1.26 takes one): pip install "
                                   "'onnxruntime-gpu>=1.26'")
        self.name = f"ort ({pathlib.Path(self.library).name}, {self.provider})"
        self._sessions = KeptSessions(_MAX_SESSIONS)  # a backend run from several threads shares them
        self._options()  # loads the library now, so a bad one is reported before any case runs

    def _options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.log_severity_level = 4  # a refused call is the outcome reported; ORT's own log would repeat it
        try:
            options.register_custom_ops_library(self.library)
        except Exception as error:  # noqa: BLE001 - ORT raises a bare RuntimeError/Fail
            raise BackendLoadError(f"--ort-library {self.library}: cannot load it ({error_text(error)})") from None
        if self.provider != "CPUExecutionProvider":
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        return options

    def _session(self, model) -> ort.InferenceSession:
        key = model.SerializeToString()

        def new_session():
            refuse_crashing_nodes(model)  # where the session is made; a kept one has passed
            return ort.InferenceSession(key, self._options(), providers=[(self.provider, self.provider_options)])
        return self._sessions.get(key, new_session)

    def run(self, op: str, inputs: dict, attributes: dict, model=None) -> Outcome:
        """Runs the call (``model``: its one-node model, built from the call when None); the in-place inputs
        of ``inputs`` hold what the op left in them afterwards, also after an error."""
        from .vectors import node_model

        bound = {}
        try:
            model = model if model is not None else node_model(op, inputs, attributes)
            session = self._session(model)
            binding = session.io_binding()
            for name, array in graph_feeds(model, inputs).items():
                bound[name] = self._bind(binding, name, array)
            for info in session.get_outputs():
                binding.bind_output(info.name, "cpu")
            try:
                session.run_with_iobinding(binding)
            finally:
                self._copy_back(op, model, inputs, bound)
            from ..ort_ops.session import to_numpy

            return Outcome(dict(zip(OUTPUTS[op], (to_numpy(v) for v in binding.get_outputs()))),
                           in_place_after(op, inputs))
        except Exception as error:  # noqa: BLE001 - session creation or run failed: the call's outcome
            return Outcome(None, in_place_after(op, inputs), error=error_text(error))

    def _bind(self, binding, name: str, array: np.ndarray) -> tuple:
        """Binds ``array`` as input ``name``; returns (host OrtValue, bound OrtValue)."""
        from ..ort_ops.session import ortvalue_for

        host = ortvalue_for(array)  # on the array's memory (int4: an ORT-owned copy)
        value = host
        if self.copy_inputs:
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), helper.np_dtype_to_tensor_dtype(array.dtype),
                                                              self.device, self.device_id)
            value.update_inplace(host)
        binding.bind_ortvalue_input(name, value)
        return host, value

    def _copy_back(self, op: str, model, inputs: dict, bound: dict) -> None:
        """Copies what the op wrote into the in-place inputs back into the caller's arrays."""
        from ..ort_ops.session import to_numpy
        from .outcome import IN_PLACE
        from .vectors import _signature

        node = model.graph.node[0]
        formal = dict(zip(node.input, _signature(node)))
        for name, (host, value) in bound.items():
            if formal[name] not in IN_PLACE[op]:
                continue
            if value is not host:
                host.update_inplace(value)  # device -> the host OrtValue (the array's own memory, or int4's copy)
            if host.data_type() == "tensor(int4)":
                inputs[formal[name]][...] = to_numpy(host)

    def close(self):
        """Drops the cached sessions."""
        self._sessions.clear()
