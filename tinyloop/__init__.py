"""TinyLoop Serve: serving weight-shared looped transformers.

The repository's top-level folders are this namespace's subpackages: `tinyloop.worker`
(engine, in-process `Model`, Ray actor), `tinyloop.kernels` (Triton), `tinyloop.gateway`
(grpc.aio front), `tinyloop.client` (stubs, client, CLI pieces), `tinyloop.train`."""
__version__ = "0.1.0"
