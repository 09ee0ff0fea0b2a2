"""The degraded-request contract between the router and the backfill service: the Kafka
topics and record headers, tickets, and the protobuf codecs both sides agree on."""
