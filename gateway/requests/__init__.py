"""Request logic: what is checked, read and written for one inference request,
whichever frontend decoded it.

- ``validation``: a decoded request against the model's metadata and config
  (names, datatypes, shapes, batch size), Triton's words for each refusal;
- ``versions``: the model version string a request names, read as Triton
  reads it (``std::stol``), with Triton's words for one it cannot read;
- ``classification``: Triton's classification extension (top-K labels from the
  model's label files) applied to a response;
- ``shared_memory``: Triton's shared-memory regions (system, and CUDA through
  ``cuda_ipc``, which alone imports cuda-python, lazily): registering them,
  reading inputs from them and writing outputs into them.

The core's request path calls ``validation``, ``versions`` and ``classification``; the
frontends call ``shared_memory`` while decoding and encoding.

May import: ``gateway.types``, ``gateway.settings`` / ``gateway.config``,
``protos``, ``serverkit``, and cuda-python (``cuda_ipc`` only, where
installed). Nothing above it in the gateway: it sits below the core and the
frontends, which both use it.
"""
