"""``square_int32``: a decoupled Triton Python-backend model, the example
repository's copy of the semantics of Triton's ``square_int32`` example.

``IN`` (INT32 [1]) = n -> n responses, each ``OUT`` (INT32 [1]) = n, then the
final flag with no data (n = 0: only the final flag). A negative n is an error
response, final. This file runs unchanged in a Triton server's Python backend
and in ``infergate worker``: it imports only numpy, the standard library and
``triton_python_backend_utils``. ``infergate models build`` writes it as
``square_int32/1/model.py``.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _cancelled(request):
    # is_cancelled() exists from Triton 23.10 on; older servers never cancel.
    check = getattr(request, "is_cancelled", None)
    return bool(check()) if check is not None else False


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                f"model '{args['model_name']}' sends any number of responses per request: "
                "its config must set model_transaction_policy { decoupled: true }"
            )
        self.out_dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "OUT")["data_type"])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0])
            if n < 0:
                error = pb_utils.TritonError(f"IN must be >= 0, got {n}")
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            out = np.array([n], dtype=self.out_dtype)
            for _ in range(n):
                if _cancelled(request):
                    break
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", out)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
