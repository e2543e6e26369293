#include "common/secrets.h"

#include <string>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

TEST(SecretsTest, TheTokenKeyIsTheHmacOfTheSecret) {
  // printf 'dbs worker token key v1' | openssl dgst -sha256 -hmac 'the-job-secret'
  EXPECT_EQ(absl::BytesToHexString(TokenKeyFromSecret("the-job-secret")),
            "b3ecbae49418f47b293ce30390d3d507248dbf186cae20ebd825e10cca64dd31");
  EXPECT_NE(TokenKeyFromSecret("the-job-secret"), TokenKeyFromSecret("the-job-secreT"));
}

TEST(SecretsTest, AnIssuedTokenPassesOnlyForItsIdAndKey) {
  const std::string key = TokenKeyFromSecret("s");
  const std::string token = IssueWorkerToken(key, 3);
  EXPECT_EQ(token.size(), 64u);
  EXPECT_TRUE(IsIssuedWorkerToken(key, 3, token));
  EXPECT_FALSE(IsIssuedWorkerToken(key, 4, token));
  EXPECT_FALSE(IsIssuedWorkerToken(TokenKeyFromSecret("t"), 3, token));
  EXPECT_NE(IssueWorkerToken(key, 3), token);  // a new nonce each time
  for (size_t i = 0; i < token.size(); ++i) {  // any digit changed: refused
    std::string bad = token;
    bad[i] = bad[i] == '0' ? '1' : '0';
    EXPECT_FALSE(IsIssuedWorkerToken(key, 3, bad)) << i;
  }
  EXPECT_FALSE(IsIssuedWorkerToken(key, 3, ""));
  EXPECT_FALSE(IsIssuedWorkerToken(key, 3, token.substr(0, 63)));
  EXPECT_FALSE(IsIssuedWorkerToken(key, 3, RandomToken() + RandomToken()));
}

TEST(SecretsTest, Sha256HexIsTheStandardDigest) {
  // FIPS 180-2's example.
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("").size(), 64u);
}

TEST(SecretsTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_EQ(RandomToken().size(), 32u);
  EXPECT_NE(RandomToken(), RandomToken());
}

}  // namespace
}  // namespace dbs
