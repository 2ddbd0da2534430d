-- pgjobs schema, version 2: settle counters, live consumers, cancellation.

-- Settled messages per queue, outcome and minute. Each process writes its own shard (host:pid),
-- so concurrent settles never wait on one row; the counter moves in the statement that settles.
CREATE TABLE {schema}.pgjobs_counter (
    queue      text NOT NULL,
    outcome    text NOT NULL,          -- acked | requeued | dead | expired | rescued | cancelled
    bucket     timestamptz NOT NULL,   -- minute the settles happened in ('-infinity': rolled up)
    shard      text NOT NULL,          -- the settling process, or 'rollup'
    n          bigint NOT NULL,
    PRIMARY KEY (queue, outcome, bucket, shard)
);
CREATE INDEX pgjobs_counter_bucket_idx ON {schema}.pgjobs_counter (bucket);
COMMENT ON TABLE {schema}.pgjobs_counter IS 'Settle counters per queue, outcome and minute.';

-- Live consumers: each consuming process upserts its row on every keeper tick.
CREATE TABLE {schema}.pgjobs_consumer (
    worker       text PRIMARY KEY,                    -- host:pid
    queues       text[] NOT NULL,                     -- queues it consumes
    held         integer NOT NULL,                    -- leases it holds
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {schema}.pgjobs_consumer IS 'Consuming processes seen in the last ticks.';

-- A running message cancelled by an operator: its ack deletes it, a requeue or a lapsed lease
-- cannot bring it back.
ALTER TABLE {schema}.pgjobs_job ADD COLUMN cancelled_at timestamptz;
