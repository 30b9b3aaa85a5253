//! [`Store`] on Redis: each method one `FCALL`, its reply read strictly.

use super::*;
use crate::list::PageFill;

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        "redis"
    }

    /// Two: the server works on one claim while the worker runs the jobs of
    /// the other.
    fn claims_in_flight(&self) -> usize {
        2
    }

    /// None: Redis has no transaction around a caller's own writes
    /// ([`Capability::CallerTransactions`]).
    fn supports(&self, _capability: Capability) -> bool {
        false
    }

    /// Relaxed when the URL said `?durability=relaxed` (the server's
    /// settings were not checked, so acknowledged jobs may be lost), or
    /// when the last maintenance pass found them changed (writes are
    /// refused until they are set back).
    fn durability(&self) -> Durability {
        if self.inner.relaxed {
            Durability::Relaxed {
                reason: "Redis opened with ?durability=relaxed: appendonly yes, appendfsync \
                         always, no-appendfsync-on-rewrite no and maxmemory-policy noeviction \
                         were not checked, so a crash or an eviction can lose acknowledged jobs"
                    .into(),
            }
        } else if let Some(reason) = self.inner.watch.drift() {
            Durability::Relaxed { reason }
        } else {
            Durability::Full
        }
    }

    async fn durability_check(&self) -> Result<()> {
        self.recheck_durability().await
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    async fn wakeups(&self) -> Result<Wakeups> {
        self.listen();
        Ok(Wakeups::local(self.inner.wakeup.clone()))
    }

    async fn now(&self) -> Result<DateTime<Utc>> {
        let v = self.run(self.fcall("now")?).await?;
        codec::ts(int(&v)?)
    }

    async fn job_enqueue(&self, p: JobEnqueue) -> Result<Vec<Result<EnqueueResult>>> {
        let mut cmd = self.fcall("enqueue")?;
        cmd.arg(if p.atomic { "1" } else { "0" })
            .arg(if p.dry_run { "1" } else { "0" });
        for item in &p.items {
            args::item(&mut cmd, item);
        }
        let v = self.run(cmd).await?;
        let replies = array(&v)?;
        if replies.len() != p.items.len() {
            return Err(codec::corrupt("enqueue results"));
        }
        let mut results = p
            .items
            .iter()
            .zip(replies)
            .map(|(item, r)| args::decision(item, r))
            .collect::<Result<Vec<_>>>()?;
        if p.atomic
            && let Some(index) = results.iter().position(Result::is_err)
        {
            // The function wrote nothing: the whole batch fails with its
            // first failing item.
            let error = match results.swap_remove(index) {
                Err(e) => e,
                Ok(_) => return Err(codec::corrupt("batch item")),
            };
            return Err(Error::BatchItem {
                index,
                error: Box::new(error),
            });
        }
        Ok(results)
    }

    async fn job_explain(&self, p: JobExplain) -> Result<Explain> {
        let mut cmd = self.fcall("explain")?;
        args::item(&mut cmd, &p.item);
        let v = self.run(cmd).await?;
        let r = array(&v)?;
        let idem = array(at(r, 1)?)?;
        let dd = array(at(r, 2)?)?;
        let mut out = Explain {
            outcome: String::new(),
            reason: None,
            job_id: None,
            conflict: None,
            idempotency: match idem {
                [job, expires] => Some(ExplainIdempotency {
                    job_id: string(job)?,
                    expires_at: codec::ts(int(expires)?)?,
                }),
                _ => None,
            },
            dedupe: match dd {
                [job, mode, until] => {
                    let job_id = string(job)?;
                    Some(ExplainDedupe {
                        mode: codec::mode(&string(mode)?, &job_id)?,
                        window_until: opt_ts(&string(until)?)?,
                        job_id,
                    })
                }
                _ => None,
            },
        };
        out.record(args::decision(&p.item, at(r, 0)?)?, p.item.job_id.clone())?;
        Ok(out)
    }

    async fn job_get(&self, p: JobRef) -> Result<Option<Job>> {
        let v = self.call1("job_get", &p.job_id).await?;
        let r = array(&v)?;
        let now = int(at(r, 0)?)?;
        r.get(1).map(|j| codec::job(j, now)).transpose()
    }

    async fn job_list(&self, p: JobListing) -> Result<JobPage> {
        let (stored, due) = (p.stored_state, p.due);
        let mut cmd = self.fcall("job_list")?;
        cmd.arg(stored.unwrap_or_default())
            .arg(match due {
                Some(true) => "1",
                Some(false) => "0",
                None => "",
            })
            .arg(p.queue.as_deref().unwrap_or_default())
            .arg(p.job_type.as_deref().unwrap_or_default())
            .arg(p.tag.as_deref().unwrap_or_default())
            .arg(p.before_seq.map(|c| c.to_string()).unwrap_or_default())
            .arg(p.limit)
            .arg(p.max_bytes.map(|b| b.to_string()).unwrap_or_default());
        let v = self.run(cmd).await?;
        let r = array(&v)?;
        let now = int(at(r, 0)?)?;
        let cursor = string(at(r, 1)?)?;
        // The function answers at most `limit` jobs, and stops before the
        // bound's bytes of stored fields (a reply of bounded size). Those
        // are encoded here as the page's JSON, which the bound holds to
        // exactly: past it they are not decoded, and the page's cursor is
        // then its last job's.
        let mut page = PageFill::new(p.limit, p.max_bytes);
        for j in &r[2..] {
            let (seq, job) = codec::listed_job(j, now)?;
            if !page.offer(seq, job)? {
                break;
            }
        }
        Ok(page.finish_with((!cursor.is_empty()).then_some(cursor)))
    }

    async fn job_events(&self, p: JobRef) -> Result<Vec<Event>> {
        let v = self.call1("job_events", &p.job_id).await?;
        let r = array(&v)?;
        codec::events(at(r, 1)?, at(r, 0)?, &p.job_id)
    }

    async fn job_runs(&self, p: JobRef) -> Result<Vec<Run>> {
        let v = self.call1("job_runs", &p.job_id).await?;
        let r = array(&v)?;
        codec::runs(at(r, 1)?, at(r, 0)?, &p.job_id)
    }

    async fn checkpoint_list(&self, p: JobRef) -> Result<BTreeMap<String, Json>> {
        let v = self.call1("checkpoint_list", &p.job_id).await?;
        codec::pairs(&v)?
            .into_iter()
            .map(|(name, v)| {
                let value = codec::checkpoint(&v, &p.job_id, &name)?;
                Ok((name, value))
            })
            .collect()
    }

    async fn job_cancel(&self, p: JobRef) -> Result<CancelOutcome> {
        let v = self.call1("cancel", &p.job_id).await?;
        match status(&v)? {
            (s, r) if s == "ok" => Ok(CancelOutcome {
                cancelled: int(at(r, 1)?)? == 1,
                state: codec::state(&string(at(r, 2)?)?, "cancel", &p.job_id)?,
            }),
            (s, _) if s == "not_found" => Err(Error::job_not_found(&p.job_id)),
            (s, _) => Err(codec::corrupt(s)),
        }
    }

    async fn job_cancel_by_key(&self, p: JobCancelByKey) -> Result<bool> {
        let mut cmd = self.fcall("cancel_by_key")?;
        cmd.arg(&p.job_type).arg(&p.key);
        Ok(int(&self.run(cmd).await?)? == 1)
    }

    async fn job_purge(&self, p: JobRef) -> Result<bool> {
        Ok(int(&self.call1("purge", &p.job_id).await?)? == 1)
    }

    async fn job_promote(&self, p: JobRef) -> Result<bool> {
        let v = self.call1("promote", &p.job_id).await?;
        match status(&v)? {
            (s, r) if s == "ok" => Ok(int(at(r, 1)?)? == 1),
            (s, _) if s == "not_found" => Err(Error::job_not_found(&p.job_id)),
            (s, _) => Err(codec::corrupt(s)),
        }
    }

    async fn job_redrive(&self, p: JobRedrive) -> Result<EnqueueResult> {
        let k = p.key.as_ref();
        let mut cmd = self.fcall("redrive")?;
        cmd.arg(&p.job_id)
            .arg(k.map(|k| k.scope.as_str()).unwrap_or_default())
            .arg(
                k.map(|k| crate::fingerprint::hex(&k.hash))
                    .unwrap_or_default(),
            )
            .arg(k.map(|k| k.preview.as_str()).unwrap_or_default())
            .arg(k.map(|k| k.ttl_ms).unwrap_or_default())
            .arg(p.fingerprint.to_json())
            .arg(p.max_attempts.map(|n| n.to_string()).unwrap_or_default())
            .arg(p.deadline.map(|n| n.to_string()).unwrap_or_default())
            .arg(p.run_at.map(|n| n.to_string()).unwrap_or_default())
            .arg(if p.reset_checkpoints { "1" } else { "0" });
        let v = self.run(cmd).await?;
        let (s, r) = status(&v)?;
        match s.as_str() {
            "ok" => {
                let outcome = string(at(r, 2)?)?;
                Ok(EnqueueResult {
                    job_id: string(at(r, 1)?)?,
                    outcome: if outcome == "replayed" {
                        crate::Outcome::Replayed
                    } else {
                        crate::Outcome::Accepted
                    },
                })
            }
            "conflict" => {
                let holder = string(at(r, 1)?)?;
                let stored = codec::fingerprint(
                    &string(at(r, 2)?)?,
                    &format!("idempotency binding of job {holder}"),
                    "idem.fp",
                )?;
                Err(Error::idempotency_conflict(
                    holder,
                    k,
                    p.fingerprint.diff(&stored, false),
                ))
            }
            "not_found" => Err(Error::job_not_found(&p.job_id)),
            "not_dead" => Err(Error::NotDead {
                job_id: p.job_id.clone(),
                state: codec::state(&string(at(r, 1)?)?, "redrive", &p.job_id)?,
            }),
            "invalid" => Err(args::clock_error(&string(at(r, 1)?)?)),
            other => Err(codec::corrupt(other)),
        }
    }

    async fn queue_pause(&self, p: QueuePause) -> Result<bool> {
        let mut cmd = self.fcall("queue_pause")?;
        cmd.arg(&p.queue).arg(if p.paused { "1" } else { "0" });
        self.run(cmd).await?;
        Ok(p.paused)
    }

    async fn queue_list(&self) -> Result<Vec<QueueInfo>> {
        let v = self.run(self.fcall("queue_list")?).await?;
        let mut out = array(&v)?
            .iter()
            .map(|q| {
                let f = array(q)?;
                let n = |i| -> Result<u64> {
                    let n = int(at(f, i)?)?;
                    u64::try_from(n).map_err(|_| codec::corrupt(format!("count {n}")))
                };
                let mut counts = crate::job::StateCounts::default();
                for (i, state) in JobState::ALL.into_iter().enumerate() {
                    counts.add(state, n(i + 2)?);
                }
                Ok(QueueInfo {
                    name: string(at(f, 0)?)?,
                    paused: int(at(f, 1)?)? == 1,
                    counts,
                    estimated: Vec::new(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn job_claim(&self, p: JobClaim) -> Result<Recording<Vec<ClaimedJob>>> {
        let mut cmd = self.fcall("claim")?;
        args::claim(&mut cmd, &p);
        let v = self.run(cmd).await?;
        let r = array(&v)?;
        Ok(Recording::new(
            args::claimed(at(r, 0)?)?,
            recorded(at(r, 1)?)?,
        ))
    }

    async fn lease_heartbeat(&self, p: LeaseRef) -> Result<Recording<Result<Heartbeat>>> {
        let mut cmd = self.fcall("heartbeat")?;
        cmd.arg(&p.job_id)
            .arg(&p.lease_token)
            .arg(rand::random::<f64>());
        let v = self.run(cmd).await?;
        match status(&v)? {
            (s, r) if s == "ok" => Ok(Recording::only(Ok(Heartbeat {
                lease_expires_at: codec::ts(int(at(r, 1)?)?)?,
                cancel_requested: int(at(r, 2)?)? == 1,
            }))),
            (s, r) if s == "lease_lost" => {
                // The state a heartbeat past the attempt's timeout or
                // deadline left the job in, once it recorded the end.
                let mut recorded = Recorded::default();
                if let Some(state) = r.get(1) {
                    recorded.ended(codec::state(&string(state)?, "heartbeat", &p.job_id)?);
                }
                Ok(Recording::new(Err(lease_lost(&p)), recorded))
            }
            (s, _) => Err(codec::corrupt(s)),
        }
    }

    async fn job_complete(&self, p: JobComplete) -> Result<()> {
        let mut done = self
            .job_complete_many(JobCompleteMany { items: vec![p] })
            .await?;
        done.pop().unwrap_or(Err(codec::corrupt("completions")))
    }

    async fn job_complete_many(&self, p: JobCompleteMany) -> Result<Vec<Result<()>>> {
        let claim = JobClaim::nothing();
        Ok(self.job_complete_and_claim(p, claim).await?.0)
    }

    async fn job_complete_and_claim(
        &self,
        done: JobCompleteMany,
        claim: JobClaim,
    ) -> Result<(Vec<Result<()>>, Result<Recording<Vec<ClaimedJob>>>)> {
        let mut cmd = self.fcall("complete_and_claim")?;
        args::completions(&mut cmd, &done.items);
        args::claim(&mut cmd, &claim);
        let v = self.run(cmd).await?;
        let r = array(&v)?;
        // The completions are recorded whatever the claim's answer holds:
        // a claimed job that does not decode is the claim's error only.
        Ok((
            args::completed(&done.items, at(r, 0)?)?,
            at(r, 1)
                .and_then(args::claimed)
                .and_then(|claimed| Ok(Recording::new(claimed, recorded(at(r, 2)?)?))),
        ))
    }

    async fn job_fail(&self, p: JobFail) -> Result<FailOutcome> {
        let mut cmd = self.fcall("fail")?;
        cmd.arg(&p.lease.job_id)
            .arg(&p.lease.lease_token)
            .arg(args::truncate(&p.error))
            .arg(if p.retryable { "1" } else { "0" })
            .arg(p.retry_after_ms.map(|n| n.to_string()).unwrap_or_default())
            .arg(p.snooze_ms.map(|n| n.to_string()).unwrap_or_default())
            .arg(rand::random::<f64>());
        let v = self.run(cmd).await?;
        match status(&v)? {
            (s, r) if s == "ok" => Ok(FailOutcome {
                state: codec::state(&string(at(r, 1)?)?, "fail", &p.lease.job_id)?,
                next_run_at: opt_ts(&string(at(r, 2)?)?)?,
            }),
            (s, _) if s == "lease_lost" => Err(lease_lost(&p.lease)),
            (s, _) => Err(codec::corrupt(s)),
        }
    }

    async fn job_release(&self, p: LeaseRef) -> Result<JobState> {
        let mut cmd = self.fcall("release")?;
        cmd.arg(&p.job_id).arg(&p.lease_token);
        let v = self.run(cmd).await?;
        match status(&v)? {
            (s, r) if s == "ok" => codec::state(&string(at(r, 1)?)?, "release", &p.job_id),
            (s, _) if s == "lease_lost" => Err(lease_lost(&p)),
            (s, _) => Err(codec::corrupt(s)),
        }
    }

    async fn checkpoint_put(&self, p: CheckpointPut) -> Result<bool> {
        let mut cmd = self.fcall("checkpoint_put")?;
        cmd.arg(&p.lease.job_id)
            .arg(&p.lease.lease_token)
            .arg(&p.name)
            .arg(&p.value);
        let v = self.run(cmd).await?;
        match status(&v)? {
            (s, r) if s == "ok" => Ok(int(at(r, 1)?)? == 1),
            (s, _) if s == "lease_lost" => Err(lease_lost(&p.lease)),
            (s, _) => Err(codec::corrupt(s)),
        }
    }

    async fn checkpoint_get(&self, p: CheckpointGet) -> Result<Option<Json>> {
        let mut cmd = self.fcall("checkpoint_get")?;
        cmd.arg(&p.job_id).arg(&p.name);
        opt_string(&self.run(cmd).await?)?
            .map(|s| codec::checkpoint(&s, &p.job_id, &p.name))
            .transpose()
    }

    async fn binding_lookup(&self, p: BindingRef) -> Result<Option<BindingInfo>> {
        let mut cmd = self.fcall("binding_lookup")?;
        cmd.arg(&p.scope).arg(crate::fingerprint::hex(&p.hash));
        let v = self.run(cmd).await?;
        match array(&v)? {
            [job, preview, expires] => Ok(Some(BindingInfo {
                job_id: string(job)?,
                key_preview: string(preview)?,
                key_digest: crate::fingerprint::key_digest(&p.hash),
                expires_at: codec::ts(int(expires)?)?,
            })),
            _ => Ok(None),
        }
    }

    async fn binding_release(&self, p: BindingRef) -> Result<bool> {
        let mut cmd = self.fcall("binding_release")?;
        cmd.arg(&p.scope).arg(crate::fingerprint::hex(&p.hash));
        Ok(int(&self.run(cmd).await?)? == 1)
    }

    async fn dedupe_lookup(&self, p: DedupeRef) -> Result<Option<ExplainDedupe>> {
        let mut cmd = self.fcall("dedupe_lookup")?;
        cmd.arg(&p.job_type).arg(&p.key);
        let v = self.run(cmd).await?;
        match array(&v)? {
            [job, mode, until] => {
                let job_id = string(job)?;
                Ok(Some(ExplainDedupe {
                    mode: codec::mode(&string(mode)?, &job_id)?,
                    window_until: opt_ts(&string(until)?)?,
                    job_id,
                }))
            }
            _ => Ok(None),
        }
    }

    async fn binding_sweep(&self, p: Sweep) -> Result<u64> {
        count(self.call1("binding_sweep", p.limit).await?)
    }

    async fn lease_reap(&self, p: Sweep) -> Result<Recorded> {
        recorded(&self.call1("lease_reap", p.limit).await?)
    }

    async fn job_retention_sweep(&self, p: Sweep) -> Result<u64> {
        count(self.call1("job_retention_sweep", p.limit).await?)
    }

    async fn schedule_put(&self, p: SchedulePut) -> Result<bool> {
        super::schedule::put(self, p).await
    }

    async fn schedule_delete(&self, p: ScheduleRef) -> Result<bool> {
        Ok(int(&self.call1("schedule_delete", &p.name).await?)? == 1)
    }

    async fn schedule_list(&self) -> Result<crate::schedule::ScheduleList> {
        super::schedule::list(self).await
    }

    async fn schedule_due(&self, p: ScheduleDue) -> Result<DueSchedules> {
        super::schedule::due(self, p).await
    }

    async fn schedule_mark_fired(&self, p: ScheduleMarkFired) -> Result<bool> {
        super::schedule::mark_fired(self, p).await
    }

    async fn installation_key_check(&self, p: KeyCheck) -> Result<String> {
        string(&self.call1("key_check", &p.value).await?)
    }

    async fn installation_key_check_replace(&self, p: KeyCheck) -> Result<KeyCheckChange> {
        let v = self.call1("key_check_replace", &p.value).await?;
        let r = array(&v)?;
        let live = int(at(r, 2)?)?;
        Ok(KeyCheckChange {
            previous: (int(at(r, 1)?)? == 1)
                .then(|| string(at(r, 0)?))
                .transpose()?,
            live_bindings: u64::try_from(live).map_err(|_| codec::corrupt(live))?,
        })
    }
}

/// An instant the functions return as µs text, `''` for none.
fn opt_ts(s: &str) -> Result<Option<DateTime<Utc>>> {
    if s.is_empty() {
        return Ok(None);
    }
    Ok(Some(codec::ts(args::parse_i64(s)?)?))
}

fn count(v: Value) -> Result<u64> {
    let n = int(&v)?;
    u64::try_from(n).map_err(|_| codec::corrupt(format!("count {n}")))
}

/// What a call recorded beside its answer, as the library answers it:
/// `{expired leases, retries, dead}`.
fn recorded(v: &Value) -> Result<Recorded> {
    let r = array(v)?;
    let n = |i| count(at(r, i)?.clone());
    Ok(Recorded {
        lease_expiries: n(0)?,
        retries: n(1)?,
        dead: n(2)?,
    })
}
