"""The aggregator: receives frames from every rank (TCP) and trace batches (HTTP), and is the
single writer of the history store."""
