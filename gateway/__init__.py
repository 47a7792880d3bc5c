"""The gRPC gateway: validation, auth, placement, handle routing, health, reflection, metrics.

It talks to the worker actors through Ray handles only and never imports torch (a test runs
`import tinyloop.gateway.server` in a fresh interpreter and checks `sys.modules`)."""
