"""Identity model: OUTPUT0 is INPUT0, for measuring gateway overhead with perf_analyzer."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's python-backend entry point for the `identity` model."""

    def execute(self, requests: list) -> list:
        # The python backend hands a batch over as separate requests: answering each with
        # its own array avoids a concatenate-and-split that would only add work.
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "OUTPUT0", pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                    )
                ]
            )
            for request in requests
        ]
