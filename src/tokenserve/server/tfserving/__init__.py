"""TF Serving's wire APIs (REST on FastAPI, gRPC with the official protos) over the lifecycle
manager."""
