"""The request id the gateway mints when the client sent none (api/middleware.py): a random UUID4 as 32 hex
digits, the shape uuid.uuid4().hex gives, accepted by the middleware's own check for client-sent ids."""

import uuid

from gateway.api.middleware import _SAFE_ID, new_request_id


def test_minted_request_ids_are_uuid4_hex_and_distinct():
    ids = [new_request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for r in ids:
        u = uuid.UUID(hex=r)
        assert u.hex == r and u.version == 4 and u.variant == uuid.RFC_4122 and _SAFE_ID.match(r)
