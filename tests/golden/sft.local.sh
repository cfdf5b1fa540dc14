#!/bin/bash
# prime-hpc sft run on this machine (cluster=local): the same components as the
# SLURM job, as local processes. Rendered from sbatch_templates/run.local.sh.j2.
# Supervision: the job is done when every non-service component exited 0 (services are
# then stopped); the first component to fail (or a service that exits) ends the whole job.
# A time limit, preemption or requeue makes the trainer and the orchestrator checkpoint the
# current step first (control/checkpoint.json), then the job goes back to the queue and its
# next attempt continues from that checkpoint. A cancel stops everything at once.
# Every component gets 20s to exit after SIGTERM before SIGKILL.
declare -A PIDS SERVICE DONE REPLICA  # REPLICA[c]=g: c is one of the interchangeable servers g
ENDED=""     # this attempt's outcome is recorded
STOPPING=""  # why the components were asked to checkpoint and stop
attempt() {  # attempt <command> [args...]: the launcher's helper for this run (prime_hpc.job.attempt)
  /opt/venv/bin/python -m prime_hpc.job.attempt "$1" /shared/runs/sft --job-id local-7 "${@:2}"
}
alive() {  # alive <pid>: is the component (any process of its group) still running?
  kill -0 -- -"$1" 2>/dev/null
}
stop_all() {  # stop_all [requeued]: TERM to every component, then KILL what is left after 20s
  local p
  for p in "${PIDS[@]}"; do kill -TERM -- -"$p" 2>/dev/null; done
  local waited=0 any p
  while [ $waited -lt 20 ]; do
    any=0
    for p in "${PIDS[@]}"; do alive "$p" && any=1; done
    [ $any -eq 0 ] && return 0
    sleep 1; waited=$((waited + 1))
  done
  for p in "${PIDS[@]}"; do kill -KILL -- -"$p" 2>/dev/null; done
}
wait_components() {  # wait_components <seconds>: until every non-service component has exited
  local waited=0 any c
  while [ $waited -lt "$1" ]; do
    any=0
    for c in "${!PIDS[@]}"; do [ "${SERVICE[$c]}" = 0 ] && alive "${PIDS[$c]}" && any=1; done
    [ $any -eq 0 ] && return 0
    sleep 1; waited=$((waited + 1))
  done
  return 1
}
reap() {  # reap <pid>: what is left of a component that exited (its process group, locally)
  kill -KILL -- -"$1" 2>/dev/null
}
kill_server() {  # kill_server <slot> [SLURM step]: a hung server of this job, at once (then restarted as lost)
  [ -n "${PIDS[$1]:-}" ] || return 0
  kill -KILL -- -"${PIDS[$1]}" 2>/dev/null
}
replicas_left() {  # replicas_left <g>: how many servers of group g are still running
  local c n=0
  for c in "${!REPLICA[@]}"; do [ "${REPLICA[$c]}" = "$1" ] && [ -z "${DONE[$c]:-}" ] && n=$((n + 1)); done
  echo $n
}
record() {  # record <rc> [component] [reason] [state]: the outcome, into job.json (once)
  [ -n "$ENDED" ] && return 0
  ENDED=1
  attempt end --rc "$1" --component "${2:-}" --reason "${3:-}" --state "${4:-}"
}
checkpoint_and_requeue() {  # checkpoint_and_requeue <why> <seconds>: the checkpoint is asked for
  STOPPING=$1; ENDED=1
  # the trainer and the orchestrator checkpoint the step they are at and exit
  wait_components "$2" || echo "prime-hpc: components still running after $2s; stopping them" >&2
  # recorded before stopping the rest: SLURM may end this script any moment now
  local rc=0
  trap '' TERM INT  # SLURM signals this script too once the job is requeued: it goes on
  attempt requeue --reason "$1" || rc=1  # back to the queue unless cluster.max_requeues is reached
  if [ $rc -eq 0 ] || [ "$1" = REQUEUED ]; then stop_all requeued; else stop_all; fi
  return $rc
}
stop_if_slurm_stops() {  # a time limit, a preemption or a requeue: checkpoint, requeue, exit
  local why
  why=$(attempt cause --checkpoint)  # CANCELLED, or TIMEOUT / PREEMPTED / REQUEUED (asked of SLURM)
  case "$why" in
    TIMEOUT|PREEMPTED|REQUEUED)
      trap '' TERM INT USR2
      echo "prime-hpc: $why: checkpointing before the job stops" >&2
      checkpoint_and_requeue "$why" 20
      exit 143 ;;
  esac
}
signalled() {  # did a component get a SIGTERM? (SLURM signals only the steps when it preempts with a grace time)
  local f
  for f in /shared/runs/sft/control/sigterm_*; do [ -e "$f" ] && return 0; done
  return 1
}
on_signal() {
  trap '' TERM INT USR2
  [ -n "$STOPPING" ] && exit 143  # already checkpointing and requeueing (SLURM ends the attempt)
  stop_if_slurm_stops
  record 143 "" "cancelled" CANCELLED
  stop_all
  exit 143
}
on_time_limit() {  # SIGUSR2, signal_delay_s before the time limit
  [ -n "$STOPPING" ] && return 0
  trap '' USR2
  STOPPING=TIMEOUT
  echo "prime-hpc: the time limit is about 120s away: checkpointing, then requeueing" >&2
  attempt checkpoint --reason TIMEOUT
  checkpoint_and_requeue TIMEOUT 90
  exit $?  # 1 when not requeued (cluster.max_requeues): the job failed, no afterok dependency starts
}
trap on_signal TERM INT
trap on_time_limit USR2

set +e -uo pipefail
umask 027  # what the run writes is not readable by other users (cluster.umask)
export PRIME_HPC_DEVICE=cpu
export PYTHONUNBUFFERED=1
export PRIME_HPC_NODE_ADDRESS=127.0.0.1
export VLLM_HOST_IP=127.0.0.1
export GLOO_SOCKET_IFNAME=lo
export NCCL_SOCKET_IFNAME=lo
export PRIME_HPC_CACHE=/shared/runs/.prime-hpc-cache
export SUBMITIT_EXECUTOR=slurm
export SRUN_EXPORT_ENV=ALL

LOGS=$(attempt start) || { echo "prime-hpc: the attempt could not start; see above" >&2; exit 1; }
export PRIME_HPC_LOGS="$LOGS"
# every listener of the job demands the job's key; it comes only through this environment
[ -n "${INFERENCE_SERVER_API_KEY:-}" ] || {
  record 1 "" "INFERENCE_SERVER_API_KEY did not reach the job's environment; nothing was started without it"
  echo "prime-hpc: INFERENCE_SERVER_API_KEY did not reach the job's environment; nothing was started without it" >&2
  exit 1
}

# The trainer's rendezvous and process group meet in files of this attempt, in the run's
# rendezvous/ (0700; on every node through the shared filesystem): torch's TCP stores would
# listen on every interface, for anyone, and a port taken meanwhile would be someone else's.
WHY=$(attempt rendezvous 2>&1 >/dev/null) || { record 1 trainer "${WHY#prime-hpc: }"; echo "$WHY" >&2; exit 1; }
RDZV=/shared/runs/sft/rendezvous/trainer_rendezvous.store; RDZV_CONF=store_type=file
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PRIME_HPC_PG_STORE=/shared/runs/sft/rendezvous/trainer_process_group.store

# Each component in a session of its own, killed by the kernel if this script dies (kill -9 included)

# trainer: torchrun on this machine
/opt/venv/bin/python -m prime_hpc.job.child $$ env OMP_NUM_THREADS=1 PRIME_HPC_CPUS=0,1 taskset -c 0,1 /opt/venv/bin/python -u -m torch.distributed.run --nnodes=1 --nproc-per-node=4 \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV" --rdzv-conf="$RDZV_CONF" --local-addr=127.0.0.1 --rdzv-id=local-7 \
  --log-dir="$LOGS/trainer/torchrun" --redirects=3 --tee=3 \
  -m prime_hpc.trainer.sft --config /shared/runs/sft/configs/trainer.yaml >"$LOGS/trainer/node_0.log" 2>&1 &
PIDS[trainer]=$!; SERVICE[trainer]=0


# the stall watchdog: reads every component's heartbeat in the run directory, and records
# this script's end in job.json if it dies without doing so
setsid /opt/venv/bin/python -u -m prime_hpc.job.watchdog /shared/runs/sft --stall-timeout-s 600 --ranks-per-node 2 --job-id local-7 --supervisor-pid $$ >"$LOGS/watchdog.log" 2>&1 &
PIDS[watchdog]=$!; SERVICE[watchdog]=1

# (supervision loop; functions at the top of the script)
while true; do
  signalled && stop_if_slurm_stops  # a component got a SIGTERM this script did not: ask SLURM why
  for c in "${!PIDS[@]}"; do
    [ -n "${DONE[$c]:-}" ] && continue
    if ! kill -0 "${PIDS[$c]}" 2>/dev/null; then  # its main process exited
      wait "${PIDS[$c]}"; rc=$?; DONE[$c]=$rc
      # a signal for the whole job (requeue, cancel) may end a component before this
      # script's own trap has run: let the trap go first, it decides what the exit means
      [ "$rc" -gt 128 ] && { sleep 2 & wait $!; }
      if [ "$c" = watchdog ] && [ "$rc" -ne 3 ]; then
        echo "prime-hpc: the stall watchdog exited with code $rc (see its log); the run goes on unwatched" >&2
        continue
      fi
      # a service or a failure may be SLURM stopping the job without signalling this script
      { [ "$rc" -ne 0 ] || [ "${SERVICE[$c]}" = 1 ]; } && [ "$c" != watchdog ] && stop_if_slurm_stops
      if [ -n "${REPLICA[$c]:-}" ]; then  # a server of the fleet: restarted in its slot while it may be
        reap "${PIDS[$c]}"
        # restarted in its slot <group>_<node> by its group's start_<group> <node>
        if attempt lost --component "$c" --rc "$rc"; then "start_${REPLICA[$c]}" "${c#*_}"; continue; fi
        if [ "$(replicas_left "${REPLICA[$c]}")" -gt 0 ]; then
          echo "prime-hpc: $c exited with code $rc; $(replicas_left "${REPLICA[$c]}") ${REPLICA[$c]} server(s) left, the run goes on" >&2
          continue
        fi
      fi
      if [ "$rc" -ne 0 ] && [ "$c" != watchdog ] && attempt node-lost; then  # it died with its node
        echo "prime-hpc: $c exited with code $rc and a node of the job failed; requeueing" >&2
        checkpoint_and_requeue NODE_FAIL 0; exit $(( $? == 0 ? 143 : 1 ))
      fi
      if [ "$rc" -ne 0 ] || [ "${SERVICE[$c]}" = 1 ]; then
        echo "prime-hpc: $c exited with code $rc; stopping the other components" >&2
        record $(( rc == 0 ? 1 : rc )) "$c" "exited with code $rc"
        stop_all; exit $(( rc == 0 ? 1 : rc ))
      fi
    fi
  done
  pending=0
  for c in "${!PIDS[@]}"; do
    [ "${SERVICE[$c]}" = 0 ] && [ -z "${DONE[$c]:-}" ] && pending=1
  done
  if [ $pending -eq 0 ]; then stop_all; record 0; exit 0; fi
  sleep 1 & wait $!
done

