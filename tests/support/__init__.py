"""What the tests share: tiny models and the references they are held to, doubles of the
engine and of the lifecycle's loader, servables and server processes, the OpenAI harness.

Imported as `support.<module>`: pyproject's pytest `pythonpath` puts tests/ on the path.
Fixtures live in the conftest of the folder whose tests use them, not here.
"""
