"""gRPC servicers: thin edges that parse, call the domain and reply."""
