// E2B's JavaScript SDK (pinned in package.json) against the broker's sandbox lifecycle, as an
// E2B user's code would meet it: isRunning after a kill, a command's timeoutMs, connect's
// timeout, Sandbox.list's pages and filters, and what a kill does to requests in flight.
// Run by protocol-tests/test_e2b.py; prints one JSON line of what it saw.
import { Sandbox } from '@e2b/code-interpreter'

const report = {}
const outcome = (p) =>
  p.then(
    () => 'returned',
    (e) => `${e.name}: ${e.message}`
  )
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const tag = `js-${Date.now()}-${Math.random().toString(16).slice(2)}`

const made = []
try {
  for (let i = 0; i < 3; i++) {
    made.push(await Sandbox.create({ metadata: { suite: tag, i: String(i) } }))
    await sleep(20)
  }
  const sbx = made[0]
  report.running = await sbx.isRunning()

  // A command's deadline: killed then, and the call fails with the SDK's timeout error.
  let t0 = Date.now()
  report.deadline = await outcome(sbx.commands.run('sleep 10; echo late > late.txt', { timeoutMs: 2000 }))
  report.deadlineMs = Date.now() - t0
  // The SDK gives up at the deadline on its own; the broker kills the command then too.
  for (let i = 0; i < 30 && (await sbx.commands.list()).length > 0; i++) await sleep(100)
  report.listedAfterDeadline = (await sbx.commands.list()).length

  // run_code's timeoutMs is the SDK's own; the broker interrupts the kernel when it gives up.
  report.codeTimeout = await outcome(sbx.runCode('import time; time.sleep(30)', { timeoutMs: 2000 }))
  t0 = Date.now()
  report.afterCodeTimeout = (await sbx.runCode('1 + 1', { timeoutMs: 10_000 })).text
  report.afterCodeTimeoutMs = Date.now() - t0

  // connect never shortens the sandbox's deadline; a longer one extends it.
  const left = async () => ((await sbx.getInfo()).endAt.getTime() - Date.now()) / 1000
  await Sandbox.connect(sbx.sandboxId, { timeoutMs: 10_000 })
  report.leftAfterShortConnect = await left()
  await Sandbox.connect(sbx.sandboxId, { timeoutMs: 900_000 })
  report.leftAfterLongConnect = await left()

  // Sandbox.list: two a page, newest first, then oldest first; filters.
  const pages = async (opts) => {
    const p = Sandbox.list(opts)
    const out = []
    while (p.hasNext) out.push((await p.nextItems()).map((s) => s.sandboxId))
    return out
  }
  const query = { metadata: { suite: tag } }
  report.ids = made.map((s) => s.sandboxId)
  report.pagesDesc = await pages({ query, limit: 2 })
  report.pagesAsc = await pages({ query, limit: 2, order: 'asc' })
  report.paused = await pages({ query: { ...query, state: ['paused'] } })
  report.startedAfter = await pages({
    query: { ...query, startedAfter: (await made[1].getInfo()).startedAt },
  })
  report.badLimit = await outcome(Sandbox.list({ query, limit: 1_000_000_000 }).nextItems())

  // A kill while code runs and a command runs: both fail as against E2B.
  const code = outcome(sbx.runCode('import time; time.sleep(60)'))
  const cmd = outcome(sbx.commands.run('sleep 60'))
  await sleep(3000)
  t0 = Date.now()
  await sbx.kill()
  report.code = await code
  report.cmd = await cmd
  report.droppedMs = Date.now() - t0
  report.runningAfterKill = await sbx.isRunning()
} finally {
  for (const s of made) await s.kill().catch(() => {})
}
console.log(JSON.stringify(report))
