"""qwen-serve: disaggregated serving for Qwen language models."""

import os
import sys

__version__ = "0.1.0"

# `--log-json` is QWENSERVE_LOG_FORMAT=json from the process's first line on, so that what is written before
# the flags are parsed (first-use progress, a refusal to start) is JSON too. gRPC's C core writes its own
# lines straight to stderr, past Python's logging, and reads GRPC_VERBOSITY once, when grpc is first
# imported (hence here, before any module imports it): under JSON logs it stays quiet unless that variable
# says otherwise; what fails reaches us as Python exceptions, which are logged.
if "--log-json" in sys.argv[1:]:
    os.environ["QWENSERVE_LOG_FORMAT"] = "json"
if os.environ.get("QWENSERVE_LOG_FORMAT", "").strip().lower() == "json":
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
