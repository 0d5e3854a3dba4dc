"""Security of the gateway: who may call what, and over which channels.

``api_keys`` owns the key store, per-key quotas and the access policy;
``frontend_auth`` enforces it in the HTTP middleware and the gRPC
interceptor; ``tls`` builds the TLS material of frontends and worker
channels; ``setup`` puts the parts together from the config and the
command line.

May import: ``gateway.config``, ``gateway.replicas.worker_client``,
``gateway.frontends.http_errors`` (the one error answer), ``protos``. Every call
passes the access check before it reaches a frontend's handler.
"""
