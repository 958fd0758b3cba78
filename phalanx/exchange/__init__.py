"""How a full bucket becomes its average: the BucketExchange interface and its implementations."""
