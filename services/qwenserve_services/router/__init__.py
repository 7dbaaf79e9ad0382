"""The router stage's gRPC service: a thin shell over the qwenserve library."""
