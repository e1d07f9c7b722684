from oauth2_provider.oauth2_validators import OAuth2Validator


class GroupsValidator(OAuth2Validator):
    """Puts the person's username, e-mail and groups (Django groups here) in the ID token and userinfo."""

    oidc_claim_scope = {**OAuth2Validator.oidc_claim_scope, "groups": "groups"}

    def get_additional_claims(self, request):
        user = request.user
        return {
            "preferred_username": user.username,
            "email": user.email,
            "groups": sorted(group.name for group in user.groups.all()),
        }

    # prompt=none (the platform's periodic session check). Django OAuth Toolkit's authorization view answers an
    # anonymous one with login_required itself; and the platform's client skips the consent screen, so a signed-in
    # person has nothing to be asked.
    def validate_silent_login(self, request):
        return True

    def validate_silent_authorization(self, request):
        return True
