"""The router's logic: choosing workers, running prefill then decode, relaying text to the client."""
