"""The router's OpenAI-compatible HTTP front: `/v1/chat/completions`, `/v1/completions`,
`/v1/models` and `/v1/ballast/backfill/{ticket}`, served on the same request path as gRPC."""
