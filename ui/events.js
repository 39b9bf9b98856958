// kernel-broker's session browser: a session's broker events (everything but its executions)
// as lines of its timeline. `describe` turns one recorded event into {what, detail, tone};
// `command` describes a command from its start and end; `egressLine` one line of a folded
// group of allowed or closed network connections. Details come from the recording and are
// shown as text only; `fork` (a fork's parent, as recorded) and `links` (the ids of a
// session's forks) are drawn by the page as links to those sessions.
'use strict';

KB.events = (function () {
  const { str, clip, bytes, frontDoor, metadataParts } = KB;

  // Who ended or let go of a session: a front door's name, or what the broker did.
  const BY = {
    rest: 'the REST API', jupyter: 'the Jupyter API', e2b: 'the E2B API', mcp: 'MCP',
    stream: 'the agent stream', broker_shutdown: 'the broker shutting down', idle_expiry: 'idle expiry',
    expired: 'idle expiry', broker_stopped: 'the broker stopping', node_lost: 'a lost node',
    mcp_session_ended: 'the end of its MCP session', sandbox_ended: 'the end of its E2B sandbox',
    setup_failed: 'a failed setup',
  };
  const by = (b) => (b ? BY[b] || clip(b, 60) : '');

  // Events whose lines are folded into one group (a kernel that downloads makes many).
  const FOLDED = new Set(['egress_allowed', 'egress_closed']);
  // Events that end a session's recording.
  const ENDED = new Set(['session_closed', 'session_expired', 'broker_stopped', 'node_lost']);
  // Events that are a cell's, not a line of their own.
  const OF_CELLS = new Set(['execution_started', 'execution_done', 'command_started', 'command_ended']);

  const hostPort = (d) => clip(d.host, 120) + (d.port !== undefined ? ':' + str(d.port) : '');
  const seconds = (s) => (typeof s === 'number' ? (s < 10 ? s.toFixed(2) : s.toFixed(0)) + ' s' : '');

  // tone: 'quiet' (grey), 'info' (blue), 'warn' (yellow), 'bad' (red).
  function describe(kind, d) {
    d = d && typeof d === 'object' ? d : {};
    switch (kind) {
      case 'session_created': {
        const door = frontDoor(d.front_door);
        return {
          what: 'session created' + (door ? ' via ' + door : ''),
          detail: [str(d.kernel), ...metadataParts(d.metadata)],
          tone: 'quiet',
          fork: d.forked_from,
        };
      }
      case 'session_forked': {
        const n = Array.isArray(d.sessions) ? d.sessions.length : 0;
        const ids = Array.isArray(d.sessions) ? d.sessions.slice(0, 8).map((s) => clip(str(s), 40)) : [];
        return { what: 'forked into ' + n + ' session' + (n === 1 ? '' : 's'), detail: ['after execution ' + str(d.execution_count)], tone: 'info', links: ids };
      }
      case 'kernel_started':
        return { what: 'kernel started', detail: [seconds(d.startup_seconds) + (d.pooled ? ' (from the pool)' : '')], tone: 'quiet' };
      case 'interrupt': return { what: 'interrupt requested', detail: [], tone: 'quiet' };
      case 'execution_timeout': return { what: 'execution timed out', detail: [d.timeout_seconds ? 'limit ' + d.timeout_seconds + ' s' : ''], tone: 'warn' };
      case 'kernel_restarted': return { what: 'kernel restarted', detail: [str(d.reason)], tone: 'warn' };
      case 'kernel_died': return { what: 'kernel died', detail: [str(d.reason)], tone: 'bad' };
      case 'session_paused':
        return { what: 'paused to disk', detail: ['after execution ' + str(d.execution_count), d.image_bytes !== undefined ? bytes(d.image_bytes) + ' on disk' : ''], tone: 'info' };
      case 'session_resumed': return { what: 'resumed', detail: ['at execution ' + str(d.execution_count)], tone: 'info' };
      case 'session_detached':
        return { what: 'detached', detail: [(by(d.by) || 'a client') + ' let go of the session; it goes on'], tone: 'info' };
      case 'session_closed': return { what: 'session closed' + (d.by ? ' by ' + by(d.by) : ''), detail: [], tone: 'quiet' };
      case 'session_expired': return { what: 'session expired', detail: ['idle for too long, or past its deadline'], tone: 'bad' };
      case 'session_kept': return { what: 'session kept', detail: ['for the broker\'s next start'], tone: 'quiet' };
      case 'broker_restarted':
        return { what: 'broker restarted', detail: ['down ' + seconds(d.down_seconds), d.kernel_alive ? 'the kernel lived' : 'the kernel was lost'], tone: 'warn' };
      case 'broker_stopped': return { what: 'broker stopped (session lost)', detail: [], tone: 'bad' };
      case 'node_lost': return { what: 'node lost (session lost)', detail: [str(d.reason)], tone: 'bad' };
      case 'recording_gap': return { what: 'gap in the recording', detail: [d.dropped !== undefined ? str(d.dropped) + ' events not recorded' : ''], tone: 'warn' };
      case 'recording_truncated':
        return { what: 'recording cut', detail: [d.scope === 'session' ? 'the session\'s cap was reached' : 'an execution\'s cap was reached', d.limit_bytes ? 'limit ' + bytes(d.limit_bytes) : ''], tone: 'warn' };
      case 'execution_refused': return { what: 'execution refused by the policy', detail: ['rule ' + clip(str(d.rule), 80), clip(str(d.what), 300)], tone: 'bad' };
      case 'output_cut': return { what: 'output cut', detail: [str(d.msg_type) + (d.bytes ? ' of ' + bytes(d.bytes) : '')], tone: 'warn' };
      case 'egress_refused':
        return { what: 'network request refused', detail: [clip(str(d.method) + ' ' + hostPort(d), 200), clip(d.reason, 300)], tone: 'bad' };
      case 'file_written': return { what: 'file written', detail: [clip(d.path, 500), bytes(d.bytes)], tone: 'info', code: 0 };
      case 'file_removed': return { what: 'file removed', detail: [clip(d.path, 500)], tone: 'info', code: 0 };
      case 'file_renamed': return { what: 'file moved', detail: [clip(d.from, 300) + ' → ' + clip(d.to, 300)], tone: 'info', code: 0 };
      default: return { what: clip(kind, 60).replace(/_/g, ' '), detail: [], tone: 'quiet' };
    }
  }

  // A command from its `command_started` and `command_ended` (either may be missing: its end
  // not yet, or cut from the recording; its start cut). `ended`: the session is over.
  function command(start, end, ended) {
    const argv = start && Array.isArray(start.argv) ? start.argv.map(str).join(' ') : '';
    const line = argv ? clip(argv, 1000) : 'command ' + str((end || {}).pid) + ' (its start was not recorded)';
    let outcome;
    let tone = 'info';
    if (end) {
      if (end.signal !== null && end.signal !== undefined) { outcome = 'killed by signal ' + str(end.signal); tone = 'bad'; }
      else { outcome = 'exit code ' + str(end.exit_code); if (end.exit_code !== 0) tone = 'bad'; }
      if (typeof end.seconds === 'number') outcome += ' · ' + seconds(end.seconds);
    } else {
      outcome = ended ? 'no end recorded (cut off)' : 'running…';
      tone = ended ? 'warn' : 'info';
    }
    const cwd = start && start.cwd ? 'in ' + clip(start.cwd, 200) : '';
    return { what: 'command', line, detail: [cwd, outcome], tone, running: !end && !ended };
  }

  function egressLine(kind, d) {
    d = d && typeof d === 'object' ? d : {};
    if (kind === 'egress_allowed') return 'allowed ' + clip(str(d.method) + ' ' + hostPort(d), 200) + (d.address ? ' (' + clip(d.address, 60) + ')' : '');
    return 'closed ' + hostPort(d) + ': sent ' + bytes(d.bytes_sent) + ', received ' + bytes(d.bytes_received) + (d.seconds !== undefined ? ', ' + seconds(d.seconds) : '');
  }

  return { describe, command, egressLine, FOLDED, ENDED, OF_CELLS, by };
})();
