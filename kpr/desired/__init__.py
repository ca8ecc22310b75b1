"""What kpr wants programmed: Services and EndpointSlices translated to frontends and backends."""
