-- pgjobs schema, version 12: `pgjobs ls --tenant` pages by index (issue 12).
--
-- The tenant index of version 7 held (tenant) only: a page of one tenant's messages in id order
-- read every entry of the tenant and sorted them. Keyed (tenant, id), a page is one index range
-- scan from the cursor, whatever the tenant's size; the tenant queue cap's bounded count reads
-- the same index (at most cap + 1 entries of the tenant). Rows without a tenant stay out of it.

CREATE INDEX IF NOT EXISTS pgjobs_job_tenant_id_idx ON {schema}.pgjobs_job (tenant, id)
    WHERE tenant IS NOT NULL;
DROP INDEX IF EXISTS {schema}.pgjobs_job_tenant_idx;
