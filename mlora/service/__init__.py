"""A Tinker-compatible LoRA training service on one mlora base: many clients' adapters trained on one model.

HTTP and protobuf at the edge (:mod:`mlora.service.app`, :mod:`mlora.service.wire`, the SDK's own protobuf
module), durable state in SQLite (:mod:`mlora.service.store`), requests ordered per client model and run as
mixed-adapter batches (:mod:`mlora.service.scheduler`) on the facade (:mod:`mlora.service.tenants`), Tinker's
losses as pure functions (:mod:`mlora.service.losses`). Nothing below this package imports it.
"""
