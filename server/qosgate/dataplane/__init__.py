"""The one request path every API's inference calls take (see `plane`), and the
generation and embedding planes built on it."""
