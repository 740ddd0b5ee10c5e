"""Transport: frames to the aggregator, and the HTTP trace exporter."""
