"""Only the first submission of a piece of work enqueues it: a dedup mark per job id, claimed in
the same script call that joins the job to its blobs' users."""

from __future__ import annotations

from collections.abc import Sequence

from redis import Redis

from wicore import keys, rq_keys
from wicore.producer.submission import ProducerConfig
from wicore.schemas import CaptionJob


def blob_shas(job: CaptionJob) -> list[str]:
    """The sha256s of the job's images that travel as blobs, each once."""
    return list(dict.fromkeys(image.sha256 for image in job.images if image.is_blob and image.sha256))


def _blob_uses(jobs: Sequence[CaptionJob], ids: list[str], shas: Sequence[str]) -> list[str | int]:
    """The mark script's per-blob arguments: each sha256, then the positions (1-based, in `ids`)
    of the jobs that use it."""
    position = {job_id: i + 1 for i, job_id in enumerate(ids)}
    users: dict[str, set[int]] = {sha: set() for sha in shas}
    for job in jobs:
        for sha in blob_shas(job):
            users.setdefault(sha, set()).add(position[job.job_id])
    return [item for sha, at in users.items() for item in (sha, len(at), *sorted(at))]


def _no_uses(shas: Sequence[str]) -> list[str | int]:
    """The mark script's per-blob arguments when no job joins its blobs' users: a lookup each."""
    return [item for sha in shas for item in (sha, 0)]


# ARGV: this producer's session, the marks' TTL, the key prefixes of dedup marks, job hashes, blobs
# and blob users, the blobs' TTL, the number n of job ids, the n job ids, then per blob: its sha256,
# the number k of those jobs that use it and their k positions among the ids (1-based). Returns 1 or
# 0 per job id (enqueue it: its mark is new, or names no job hash), then per blob (it is in Redis
# already). The jobs to enqueue join their blobs' users (`keys.BLOB_USERS`) here, in the step that
# finds a blob stored, so that no worker ending a blob's last other user deletes it in between.
_MARK_LUA = """
local session, ttl, marks, jobs, blobs, users = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local blob_ttl, n = ARGV[7], tonumber(ARGV[8])
local out = {}
for i = 9, 8 + n do
  local new = redis.pcall('SET', marks .. ARGV[i], session, 'NX', 'EX', ttl)
  if type(new) == 'table' and new.err then  -- refused (maxmemory, a read-only replica): Redis' own error
    return redis.error_reply((string.gsub(new.err, '^@user_script:%s*%d+:%s*%-', '')))
  end
  out[#out + 1] = (new or redis.call('EXISTS', jobs .. ARGV[i]) == 0) and 1 or 0
end
local stored = {}
local i = 9 + n
while i <= #ARGV do
  local sha, k = ARGV[i], tonumber(ARGV[i + 1])
  local joining = {}
  for j = i + 2, i + 1 + k do
    local at = tonumber(ARGV[j])
    if out[at] == 1 then joining[#joining + 1] = ARGV[8 + at] end
  end
  if #joining > 0 then
    redis.call('SADD', users .. sha, unpack(joining))
    redis.call('EXPIRE', users .. sha, blob_ttl)
  end
  stored[#stored + 1] = redis.call('EXISTS', blobs .. sha)
  i = i + 2 + k
end
for _, flag in ipairs(stored) do out[#out + 1] = flag end
return out
"""


class Claims:
    """A producer's claims on the work it submits: its dedup marks, and its jobs' places among
    their blobs' users."""

    def __init__(self, connection: Redis, session: str, config: ProducerConfig):
        self.session, self.config = session, config
        self._mark = connection.register_script(_MARK_LUA)

    def claim_new(self, jobs: Sequence[CaptionJob], blob_shas: Sequence[str]) -> tuple[set[str], set[str]]:
        """(ids to enqueue, blobs already in Redis), in one script call: only the first submission
        of a piece of work enqueues it (a failed or canceled job drops its mark, so resubmitting
        it runs it again), and joins its blobs' users. A mark without a job hash is a submission
        whose enqueue never happened (refused for memory or by admission control, or its producer
        died between the two round trips): that id is enqueued now."""
        unique = list(dict.fromkeys(job.job_id for job in jobs))
        prefixes = [keys.submitted(""), rq_keys.JOB, keys.blob(""), keys.blob_users("")]
        args = [self.session, self.config.result_ttl_s, *prefixes, self.config.blob_ttl_s, len(unique), *unique]
        uses = _blob_uses(jobs, unique, blob_shas) if self.config.release_blobs else _no_uses(blob_shas)
        flags = self._mark(args=[*args, *uses])
        new_ids = {job_id for job_id, flag in zip(unique, flags) if flag}
        return new_ids, {sha for sha, flag in zip(blob_shas, flags[len(unique) :]) if flag}
