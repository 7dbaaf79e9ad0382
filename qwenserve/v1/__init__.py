"""Generated gRPC code for the qwenserve.v1 contracts (make proto)."""
