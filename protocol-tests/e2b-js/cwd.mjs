// E2B's JavaScript SDK (pinned in package.json): a command's working directory that does not
// exist is refused before the command starts, as envd refuses it.
// Run by protocol-tests/test_e2b_commands_cwd.py; prints one JSON line of what it saw.
import { Sandbox } from 'e2b'

const sbx = await Sandbox.create()
try {
  let missing = 'returned'
  try {
    await sbx.commands.run('touch js-ran', { cwd: '/home/user/js-missing' })
  } catch (e) {
    missing = `${e.name}: ${e.message}`
  }
  const ran = await sbx.files.exists('js-ran')
  await sbx.files.makeDir('js-here')
  const here = (await sbx.commands.run('pwd', { cwd: 'js-here' })).stdout
  console.log(JSON.stringify({ missing, ran, here }))
} finally {
  await sbx.kill().catch(() => {})
}
