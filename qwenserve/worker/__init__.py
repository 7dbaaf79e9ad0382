"""What a prefill or decode process does with a request, independent of the gRPC servicer around it."""
