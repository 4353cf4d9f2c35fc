"""State beyond one process: the Redis KV tier and stored Responses-API conversations."""
