// E2B's JavaScript SDK's pseudo-terminals (pinned in package.json) against the broker, as an
// E2B user's code would run them: create with onData, sendInput, resize, connect from a
// second handle, kill; and the sandbox's metrics (getMetrics, on the instance and static).
// Run by protocol-tests/test_e2b_pty.py; prints one JSON line.
import { Sandbox } from '@e2b/code-interpreter'

const sbx = await Sandbox.create()
const decoder = () => {
  const d = new TextDecoder()
  const out = { text: '' }
  out.onData = (bytes) => { out.text += d.decode(bytes, { stream: true }) }
  return out
}
// A line the terminal printed (not the echo of the input): the needle at the start of a
// line (after bash's bracketed-paste escape, if any), then CR LF.
const escaped = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')
const waitFor = async (screen, needle, ms = 30000) => {
  const line = new RegExp('(^|[\\r\\n]|\\x1b\\[\\?2004l\\r?)' + escaped(needle) + '\\r\\n')
  const until = Date.now() + ms
  while (Date.now() < until) {
    if (line.test(screen.text)) return true
    await new Promise((r) => setTimeout(r, 50))
  }
  throw new Error(`${JSON.stringify(needle)} never appeared in ${JSON.stringify(screen.text.slice(-1000))}`)
}
const enc = (s) => new TextEncoder().encode(s)
try {
  const first = decoder()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: first.onData, timeoutMs: 120000 })
  await sbx.pty.sendInput(term.pid, enc('echo hi\n'))
  const hi = await waitFor(first, 'hi')
  await sbx.pty.sendInput(term.pid, enc('stty size\n'))
  const size24x80 = await waitFor(first, '24 80')
  await sbx.pty.resize(term.pid, { cols: 120, rows: 30 })
  await sbx.pty.sendInput(term.pid, enc('stty size\n'))
  const size30x120 = await waitFor(first, '30 120')
  const second = decoder()
  const again = await sbx.pty.connect(term.pid, { onData: second.onData, timeoutMs: 60000 })
  await sbx.pty.sendInput(term.pid, enc('echo connected-$((40+2))\n'))
  const connected = await waitFor(second, 'connected-42')
  const killed = await sbx.pty.kill(term.pid)
  await term.wait().catch(() => {})
  await again.wait().catch(() => {})
  const killedAgain = await sbx.pty.kill(term.pid)
  let badSize = 'returned'
  try {
    await sbx.pty.create({ cols: 0, rows: 24, onData: () => {} })
  } catch (e) {
    badSize = `${e.name}: ${e.message}`
  }
  const metric = (await sbx.getMetrics()).at(-1)
  const team = await Sandbox.getMetrics(sbx.sandboxId)
  let otherUser = 'returned'
  try {
    await Sandbox.getMetrics(sbx.sandboxId, { apiKey: process.env.KB_OTHER_KEY })
  } catch (e) {
    otherUser = `${e.name}: ${e.message}`
  }
  await sbx.kill()
  console.log(JSON.stringify({
    hi, size24x80, size30x120, connected, killed, killedAgain, badSize,
    metric: { ...metric, timestamp: metric.timestamp.toISOString() }, teamCount: team.length, otherUser,
  }))
} catch (e) {
  await sbx.kill().catch(() => {})
  throw e
}
