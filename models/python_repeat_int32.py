"""``repeat_int32``: a decoupled Triton Python-backend model, the example
repository's copy of the semantics of Triton's ``repeat_int32`` example.

Inputs ``IN`` (INT32 [-1]) values, ``DELAY`` (UINT32 [-1], as many as ``IN``)
milliseconds before each response, ``WAIT`` (UINT32 [1]) milliseconds, at
least, before the request is released. One response per value, in order:
``OUT`` (INT32 [1]) = the value, ``IDX`` (UINT32 [1]) = its index; then the
final flag with no data. ``DELAY`` of another length than ``IN`` fails the
request (``execute`` raises).

It waits in slices of 10 ms and checks ``request.is_cancelled()`` between
them, so a cancelled request frees its instance within a slice. It runs
unchanged in a Triton server's Python backend and in ``infergate worker``;
``infergate models build`` writes it as ``repeat_int32/1/model.py``.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SLICE_S = 0.01


def _cancelled(request):
    # is_cancelled() exists from Triton 23.10 on; older servers never cancel.
    check = getattr(request, "is_cancelled", None)
    return bool(check()) if check is not None else False


def _wait_until(deadline, request):
    """Sleep until ``deadline`` (time.monotonic()) in slices; False as soon as the request is cancelled."""
    while True:
        if _cancelled(request):
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(SLICE_S, left))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                f"model '{args['model_name']}' sends any number of responses per request: "
                "its config must set model_transaction_policy { decoupled: true }"
            )
        self.out_dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "OUT")["data_type"])
        self.idx_dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "IDX")["data_type"])

    def execute(self, requests):
        for request in requests:
            start = time.monotonic()
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy().reshape(-1)
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy().reshape(-1)
            if delays.size != values.size:
                raise pb_utils.TritonModelException(
                    f"DELAY must have as many elements as IN ({values.size}), got {delays.size}"
                )
            sender = request.get_response_sender()
            due = start
            for index in range(values.size):
                due += float(delays[index]) / 1000.0
                if not _wait_until(due, request):
                    break
                outputs = [
                    pb_utils.Tensor("OUT", np.array([values[index]], dtype=self.out_dtype)),
                    pb_utils.Tensor("IDX", np.array([index], dtype=self.idx_dtype)),
                ]
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
            else:
                _wait_until(start + float(wait[0]) / 1000.0 if wait.size else start, request)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
